// kvxfer from C++ (include/kvxfer.hpp, a header-only wrapper over the C ABI): an engine on
// the default device (GPU 0, or the emulated device where there is none), a host layout
// and a disk layout; four blocks are written to the file, read back through the device
// into four other host blocks, and compared. Failures throw kvx::Error.
// Build and run from the repository root, after `cargo build --release`:
//   c++ -std=c++17 -Iinclude examples/cpp/transfer.cpp -Ltarget/release -Wl,-rpath,$PWD/target/release -lkvxfer -o transfer && ./transfer
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kvxfer.hpp"

int main(int argc, char **argv) {
  const std::string path = std::string(argc > 1 ? argv[1] : ".") + "/kvx-example-cpp.kv";
  try {
    kvx::Engine e;  // the default settings
    const auto config = kvx::layout_config()  // contiguous; every dimension named
                            .set_num_blocks(8)
                            .set_num_layers(2)
                            .set_outer_dim(2)
                            .set_page_size(16)
                            .set_inner_dim(128)
                            .set_dtype_bytes(2);
    kvx::Layout host = e.create_host_layout(config);        // pinned
    kvx::Layout disk = e.create_disk_layout(config, path);  // the file goes with the layout
    kvx::Layout dev = e.create_device_layout(config);
    const uint64_t block = host.block_bytes();
    auto *bytes = reinterpret_cast<unsigned char *>(host.base());
    for (uint64_t i = 0; i < 4 * block; i++) bytes[i] = (unsigned char)(i * 7 + 1);
    const std::vector<uint64_t> first = {0, 1, 2, 3}, other = {4, 5, 6, 7};
    e.submit(host, first, disk, first).wait();  // host blocks 0-3 to the file's 0-3
    e.submit(disk, first, dev, other).wait();   // the file's 0-3 to device blocks 4-7
    e.submit(dev, other, host, other).wait();   // and to host blocks 4-7
    const bool same = std::memcmp(bytes, bytes + 4 * block, 4 * block) == 0;
    std::printf("transfer.cpp (%s): 4 blocks to disk and back, %s\n", kvx_version_string(),
                same ? "every byte the same" : "BYTES DIFFER");
    return same ? 0 : 1;
  } catch (const kvx::Error &err) {
    std::fprintf(stderr, "transfer.cpp: %s\n", err.what());
    return 1;
  }
}
