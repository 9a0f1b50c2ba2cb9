// The store from C++ (include/kvxfer.hpp): four blocks of a host layout are put under their
// keys (a runtime's prefix hashes), looked up, loaded by key through the device (GPU 0, or the
// emulated one) into a host layout, compared and removed; failures throw.
//   c++ -std=c++17 -Iinclude examples/cpp/store.cpp -Ltarget/release -Wl,-rpath,$PWD/target/release -lkvxfer && ./a.out
#include <cstdio>
#include <cstring>

#include "kvxfer.hpp"

int main() try {
  kvx::Engine e;
  const auto c = kvx::layout_config().set_num_blocks(8).set_num_layers(2).set_outer_dim(2)
                     .set_page_size(16).set_inner_dim(128).set_dtype_bytes(2);
  kvx::Layout host = e.create_host_layout(c), dev = e.create_device_layout(c);
  const uint64_t block = host.block_bytes();
  auto *bytes = reinterpret_cast<unsigned char *>(host.base());
  for (uint64_t i = 0; i < 4 * block; i++) bytes[i] = (unsigned char)(i * 5 + 3);
  const std::string ns = "example-model bf16 tp0/1 page16";  // what makes equal keys differ
  auto sc = kvx::store_config();  // KVX_STORE_CREATE, one shard
  sc.block = &c, sc.capacity_blocks = 64;
  sc.namespace_bytes = reinterpret_cast<const uint8_t *>(ns.data()), sc.namespace_len = (uint32_t)ns.size();
  kvx::Store store(e, "kvx-example-store-cpp", sc);  // a directory: made, or reopened
  const std::vector<std::string> hashes = {"hash-a", "hash-b", "hash-c", "hash-d"};
  const std::vector<kvx_key> keys = kvx::keys_of(hashes);  // views of `hashes`
  store.put(host, {0, 1, 2, 3}, keys).wait();  // host blocks 0-3 under the four keys
  const kvx::Store::Lookup found = store.lookup(keys, KVX_LOOKUP_LEASE);  // leased until loaded
  kvx::StoreRequest get = store.get(keys, dev, {4, 5, 6, 7});  // to device blocks 4-7
  if (get.wait_for(UINT64_MAX) != KVX_OK)  // or get.wait(), which throws
    for (size_t i = 0; i < keys.size(); i++) std::fprintf(stderr, "key %zu: %s\n", i, get.key_error(i).c_str());
  e.submit(dev, {4, 5, 6, 7}, host, {4, 5, 6, 7}).wait();  // and to host 4-7
  const bool same = found.leading_hits == 4 && get.key_status(3) == KVX_OK &&
                    std::memcmp(bytes, bytes + 4 * block, 4 * block) == 0;
  store.remove(keys);
  std::printf("store.cpp: %zu of 4 keys held, %s; %llu entries left\n", found.leading_hits,
              same ? "every byte the same" : "BYTES DIFFER", (unsigned long long)store.stats().entries);
  return same ? 0 : 1;
} catch (const kvx::Error &err) {
  std::fprintf(stderr, "store.cpp: %s\n", err.what());
  return 1;
}
