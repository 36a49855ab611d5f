#include "client/verify.h"

#include <algorithm>
#include <chrono>
#include <memory>

#include "checkpoint/dtype.h"
#include "client/attachment_impl.h"
#include "client/parallel.h"
#include "common/checksum.h"
#include "common/hash.h"
#include "common/mutex.h"
#include "cuda/checksum_gpu.h"

namespace weightcache::client {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kFileReadPiece = uint64_t{16} << 20;  // a multiple of the checksum chunk

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

Result<std::vector<uint64_t>> GpuChecksums(const Attachment& attachment) {
  // The driver and device the attach mapped with (its Env's), never a second lookup.
  const Attachment::Impl& impl = AttachmentAccess::Of(attachment);
  if (impl.driver == nullptr) {
    return InternalError("gpu tier attachment of " + attachment.device_key() +
                         " holds no CUDA driver");
  }
  const cuda::DriverApi* api = impl.driver;
  const CUdevice dev = impl.cu_device;
  // The memory lives in the primary context (client.h); make it current on this thread, and
  // give the caller's thread back its own context afterwards.
  const cuda::CallerContextGuard caller_context(api);
  WEIGHTCACHE_ASSIGN_OR_RETURN(cuda::PrimaryContext context,
                               cuda::PrimaryContext::Retain(api, dev));
  std::vector<cuda::DeviceRange> ranges;
  ranges.reserve(attachment.tensors().size());
  for (const Tensor& t : attachment.tensors()) ranges.push_back({t.data, t.nbytes});
  return cuda::GpuTensorChecksums(api, /*stream=*/nullptr, ranges);
}

// The checksum of a tensor's bytes in its shard file, streamed through one buffer.
Result<uint64_t> FileChecksum(const checkpoint::Checkpoint& ckpt,
                              const checkpoint::TensorInfo& info, std::vector<uint8_t>& buffer) {
  ChecksumBuilder builder;
  checkpoint::ReadOptions one_thread;
  one_thread.threads = 1;
  for (uint64_t done = 0; done < info.nbytes;) {
    uint64_t length = std::min<uint64_t>(kFileReadPiece, info.nbytes - done);
    checkpoint::ReadRequest request{info.shard, info.offset + done, length, buffer.data()};
    WEIGHTCACHE_RETURN_IF_ERROR(checkpoint::ReadRanges(ckpt, {&request, 1}, one_thread));
    builder.Update(buffer.data(), length);
    done += length;
  }
  return builder.Finish();
}

std::string ShapeText(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

Result<std::vector<uint64_t>> MemoryChecksums(const Attachment& attachment, int threads) {
  if (attachment.tier() == Tier::kGpu) return GpuChecksums(attachment);
  const auto& tensors = attachment.tensors();
  std::vector<uint64_t> out(tensors.size());
  ParallelFor(tensors.size(), threads,
              [&](size_t i) { out[i] = TensorChecksum(tensors[i].host_ptr(), tensors[i].nbytes); });
  return out;
}

Result<VerifyReport> VerifyChecksums(const Attachment& attachment, int threads) {
  const auto start = Clock::now();
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint64_t> sums, MemoryChecksums(attachment, threads));
  VerifyReport report;
  const auto& tensors = attachment.tensors();
  for (size_t i = 0; i < tensors.size(); ++i) {
    ++report.tensors_checked;
    report.bytes_checked += tensors[i].nbytes;
    if (sums[i] != tensors[i].checksum) {
      report.problems.push_back({std::string(tensors[i].name), "checksum " + Hex64(sums[i]) +
                                                                   " of the memory != recorded " +
                                                                   Hex64(tensors[i].checksum)});
    }
  }
  report.seconds = SecondsSince(start);
  return report;
}

Result<VerifyReport> VerifyAgainstCheckpoint(const Attachment& attachment,
                                             const checkpoint::Checkpoint& checkpoint,
                                             int threads) {
  const auto start = Clock::now();
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint64_t> memory, MemoryChecksums(attachment, threads));
  const auto& tensors = attachment.tensors();
  const auto& infos = checkpoint.tensors();
  VerifyReport report;
  Mutex mu;
  Status first_error;
  std::vector<uint64_t> file_sums(infos.size());
  ParallelFor(infos.size(), threads, [&](size_t i) {
    thread_local std::vector<uint8_t> buffer;
    buffer.resize(kFileReadPiece);
    auto sum = FileChecksum(checkpoint, infos[i], buffer);
    MutexLock lock(mu);
    if (!sum.ok()) {
      if (first_error.ok()) first_error = sum.status();
      return;
    }
    file_sums[i] = *sum;
  });
  WEIGHTCACHE_RETURN_IF_ERROR(first_error);

  for (size_t i = 0; i < infos.size(); ++i) {
    const auto& info = infos[i];
    const Tensor* t = attachment.Find(info.name);
    if (t == nullptr) {
      report.problems.push_back({info.name, "in the checkpoint but missing from the cache"});
      continue;
    }
    ++report.tensors_checked;
    report.bytes_checked += info.nbytes;
    std::vector<int64_t> shape(info.shape.begin(), info.shape.end());
    std::string dtype(checkpoint::DTypeName(info.dtype));
    if (t->dtype != dtype || !std::ranges::equal(t->shape, shape) || t->nbytes != info.nbytes) {
      report.problems.push_back(
          {info.name, "cache has " + std::string(t->dtype) + ShapeText(t->shape) + " (" +
                          std::to_string(t->nbytes) + " bytes), file has " + dtype +
                          ShapeText(shape) + " (" + std::to_string(info.nbytes) + " bytes)"});
      continue;
    }
    uint64_t mem = memory[static_cast<size_t>(t - tensors.data())];
    if (mem != file_sums[i]) {
      report.problems.push_back({info.name, "memory checksum " + Hex64(mem) + " != file checksum " +
                                                Hex64(file_sums[i])});
    }
  }
  for (const Tensor& t : tensors) {
    if (checkpoint.Find(t.name) == nullptr) {
      report.problems.push_back({std::string(t.name), "in the cache but not in the checkpoint"});
    }
  }
  report.seconds = SecondsSince(start);
  return report;
}

}  // namespace weightcache::client
