// kvxfer from C++ (include/kvxfer.hpp, header-only): four blocks of a host layout go to a file,
// come back through the device (GPU 0, or the emulated one) into four others; failures throw.
//   c++ -std=c++17 -Iinclude examples/cpp/transfer.cpp -Ltarget/release -Wl,-rpath,$PWD/target/release -lkvxfer && ./a.out
#include <cstdio>
#include <cstring>

#include "kvxfer.hpp"

int main() try {
  kvx::Engine e;  // default settings
  const auto c = kvx::layout_config().set_num_blocks(8).set_num_layers(2).set_outer_dim(2)
                     .set_page_size(16).set_inner_dim(128).set_dtype_bytes(2);
  kvx::Layout host = e.create_host_layout(c), dev = e.create_device_layout(c);  // pinned host
  kvx::Layout disk = e.create_disk_layout(c, "kvx-example-cpp.kv");  // the file goes with the layout
  const uint64_t block = host.block_bytes();
  auto *bytes = reinterpret_cast<unsigned char *>(host.base());
  for (uint64_t i = 0; i < 4 * block; i++) bytes[i] = (unsigned char)(i * 7 + 1);
  e.submit(host, {0, 1, 2, 3}, disk, {0, 1, 2, 3}).wait();  // host 0-3 to the file
  e.submit(disk, {0, 1, 2, 3}, dev, {4, 5, 6, 7}).wait();   // the file to device 4-7
  e.submit(dev, {4, 5, 6, 7}, host, {4, 5, 6, 7}).wait();   // and to host 4-7
  const bool same = std::memcmp(bytes, bytes + 4 * block, 4 * block) == 0;
  std::printf("transfer.cpp: 4 blocks to disk and back, %s\n", same ? "every byte the same" : "BYTES DIFFER");
  return same ? 0 : 1;
} catch (const kvx::Error &err) {
  std::fprintf(stderr, "transfer.cpp: %s\n", err.what());
  return 1;
}
