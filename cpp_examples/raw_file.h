// The bench's raw file I/O limit: pread/pwrite of the file by a pool of threads that live
// across passes, each with its own buffer touched once, so a pass times the I/O alone and
// not thread start-up or the first-touch page faults of fresh buffers (which cost more
// than a hot 12.6 MB read itself). `best` sweeps thread count and I/O size: the limit is
// the best the hardware does, not the figure at kvxfer's own settings.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

class RawFilePool {
 public:
  // `threads` workers, each with a buffer of `max_io` bytes.
  RawFilePool(uint32_t threads, uint64_t max_io) : max_io_(max_io) {
    for (uint32_t t = 0; t < threads; t++) {
      void *buf = nullptr;
      if (posix_memalign(&buf, 4096, max_io) != 0) {
        std::fprintf(stderr, "bench: cannot allocate %llu bytes for the raw pass\n", (unsigned long long)max_io);
        std::exit(1);
      }
      std::memset(buf, 0x5a, max_io);
      bufs_.push_back(buf);
    }
    for (uint32_t t = 0; t < threads; t++) pool_.emplace_back([this, t] { work(t); });
  }
  ~RawFilePool() {
    {
      std::lock_guard<std::mutex> g(m_);
      stop_ = true;
      gen_++;
    }
    cv_.notify_all();
    for (auto &t : pool_) t.join();
    for (void *b : bufs_) std::free(b);
  }
  uint32_t threads() const { return (uint32_t)pool_.size(); }

  struct Best {
    double seconds;
    uint32_t threads;
    uint64_t io;
    // How long the pass's workers took to wake, from the notify to the last one ready:
    // not in `seconds`, which starts with every worker awake.
    double wake_seconds = 0;
  };

  // Seconds for `bytes` of the file moved by `threads` workers, `io` bytes per call.
  double pass(const std::string &path, uint64_t bytes, uint32_t threads, uint64_t io, bool buffered, bool write) {
    return run(path, Job{-1, bytes, std::min(io, max_io_), threads, write, nullptr}, buffered);
  }

  // The fastest of 1, 2, 4, ... workers (up to the pool's), each with I/Os of `chunk`
  // bytes or of an equal share of the file, best of `tries`.
  Best best(const std::string &path, uint64_t bytes, uint64_t chunk, bool buffered, bool write, int tries) {
    Best b{1e30, 0, 0};
    std::vector<uint32_t> counts;
    for (uint32_t n = 1; n < threads(); n *= 2) counts.push_back(n);
    counts.push_back(threads());
    for (uint32_t n : counts) {
      uint64_t share = (bytes + n - 1) / n;
      share = (share + 4095) / 4096 * 4096;
      for (uint64_t io : {chunk, share}) {
        if (io > max_io_) continue;
        for (int i = 0; i < tries; i++) {
          double s = pass(path, bytes, n, io, buffered, write);
          if (s < b.seconds) b = Best{s, n, io};
        }
      }
    }
    return b;
  }

  // (file offset, length) pieces, each at most the pool's buffer.
  using Extents = std::vector<std::pair<uint64_t, uint64_t>>;

  // The fastest read of `extents` by 1, 2, 4, ... workers, each taking the next extent,
  // best of `tries`: what one scattered request's reads need at least.
  Best best_extents(const std::string &path, const Extents &extents, bool buffered, int tries) {
    Best b{1e30, 0, 0};
    for (uint32_t n = 1;; n = std::min(2 * n, threads())) {
      for (int i = 0; i < tries; i++) {
        double s = run(path, Job{-1, 0, 0, n, false, &extents}, buffered);
        if (s < b.seconds) b = Best{s, n, 0, last_wake_};
      }
      if (n == threads()) return b;
    }
  }

 private:
  struct Job {
    int fd = -1;
    uint64_t bytes = 0, io = 0;
    uint32_t threads = 0;
    bool write = false;
    // When set, the pieces to read instead of `bytes` from the start.
    const Extents *extents = nullptr;
  };

  double run(const std::string &path, Job job, bool buffered) {
    bool write = job.write;
    int fd = ::open(path.c_str(), (write ? O_WRONLY : O_RDONLY) | (buffered ? 0 : O_DIRECT));
    if (fd < 0) { std::perror("bench: open for the raw pass"); std::exit(1); }
    job.fd = fd;
    job.threads = std::min<uint32_t>(job.threads, (uint32_t)pool_.size());
    {
      std::lock_guard<std::mutex> g(m_);
      job_ = job;
      next_ = 0;
      ready_ = 0;
      done_ = 0;
      go_ = false;
      failed_ = false;
      gen_++;
    }
    auto woken = std::chrono::steady_clock::now();
    cv_.notify_all();
    // The clock starts once every worker taking part is awake and waiting on `go_`.
    while (ready_.load(std::memory_order_acquire) < job_.threads) std::this_thread::yield();
    auto t0 = std::chrono::steady_clock::now();
    last_wake_ = std::chrono::duration<double>(t0 - woken).count();
    go_.store(true, std::memory_order_release);
    while (done_.load(std::memory_order_acquire) < job_.threads) std::this_thread::yield();
    if (write) ::fdatasync(fd);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ::close(fd);
    if (failed_) { std::fprintf(stderr, "bench: raw %s of %s failed\n", write ? "write" : "read", path.c_str()); std::exit(1); }
    return s;
  }

  void work(uint32_t t) {
    uint64_t seen = 0;
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> g(m_);
        cv_.wait(g, [&] { return gen_ != seen; });
        seen = gen_;
        if (stop_) return;
        job = job_;
      }
      if (t >= job.threads) continue;
      ready_.fetch_add(1, std::memory_order_acq_rel);
      while (!go_.load(std::memory_order_acquire)) std::this_thread::yield();
      for (;;) {
        uint64_t off, n;
        if (job.extents) {
          uint64_t i = next_.fetch_add(1);
          if (i >= job.extents->size()) break;
          off = (*job.extents)[i].first, n = std::min((*job.extents)[i].second, max_io_);
        } else {
          off = next_.fetch_add(job.io);
          if (off >= job.bytes) break;
          n = std::min(job.io, job.bytes - off);
        }
        ssize_t got = job.write ? ::pwrite(job.fd, bufs_[t], n, (off_t)off) : ::pread(job.fd, bufs_[t], n, (off_t)off);
        if (got != (ssize_t)n) {
          failed_ = true;
          break;
        }
      }
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  uint64_t max_io_;
  double last_wake_ = 0;
  std::vector<void *> bufs_;
  std::vector<std::thread> pool_;
  std::mutex m_;
  std::condition_variable cv_;
  uint64_t gen_ = 0;
  bool stop_ = false;
  Job job_;
  std::atomic<uint64_t> next_{0};
  std::atomic<uint32_t> ready_{0}, done_{0};
  std::atomic<bool> go_{false}, failed_{false};
};
