// A program that uses an installed kvxfer (found by CMake's find_package or by
// pkg-config): moves blocks host -> disk -> emulated device -> host and checks them.
#include <cstdio>
#include <cstring>
#include <string>
#include <unistd.h>

#include <kvxfer.hpp>

int main(int argc, char **argv) {
  std::string dir = argc > 1 ? argv[1] : "/tmp";
  try {
    kvx_engine_config ec;
    kvx_engine_config_init(&ec);
    ec.device = KVX_DEVICE_EMULATED;
    ec.bounce_bytes = 1 << 20;
    ec.slot_bytes = 64 << 10;
    kvx::Engine e(&ec);
    auto c = kvx::layout_config().set_num_blocks(4).set_num_layers(2).set_outer_dim(2).set_page_size(8).set_inner_dim(64).set_dtype_bytes(2);
    kvx::Layout host = e.create_host_layout(c, 0), back = e.create_host_layout(c, 0);
    kvx::Layout disk = e.create_disk_layout(c, dir + "/kvx-consumer-" + std::to_string(getpid()));
    c.kind = KVX_LAYOUT_LAYER_SEPARATE_OUTER_FIRST;
    kvx::Layout dev = e.create_device_layout(c);
    auto *p = reinterpret_cast<unsigned char *>(host.base());
    for (uint64_t i = 0; i < 4 * host.block_bytes(); i++) p[i] = (unsigned char)(i * 13 + 1);
    std::vector<uint64_t> ids = {0, 1, 2, 3};
    e.submit(host, ids, disk, ids).wait();
    e.submit(disk, ids, dev, ids).wait();
    e.submit(dev, ids, back, ids).wait();
    bool same = std::memcmp(p, reinterpret_cast<void *>(back.base()), 4 * host.block_bytes()) == 0;
    std::printf("consumer (%s): %s\n", kvx_version_string(), same ? "ok" : "BYTES DIFFER");
    return same ? 0 : 1;
  } catch (const kvx::Error &err) {
    std::fprintf(stderr, "consumer: %s\n", err.what());
    return 1;
  }
}
