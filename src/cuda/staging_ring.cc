#include "cuda/staging_ring.h"

#include <algorithm>

namespace weightcache::cuda {

StagingRing::StagingRing(const DriverApi* api, CUcontext context, size_t slots, size_t bytes,
                         size_t group, std::vector<PinnedHostBuffer> made)
    : api_(api),
      context_(context),
      bytes_(bytes),
      slots_(slots),
      group_(std::max<size_t>(group, 1)),
      pins_((slots + group_ - 1) / group_) {
  if (made.size() != pins_) return;
  MutexLock lock(mu_);
  for (size_t s = 0; s < slots_; ++s) {
    data_.push_back(made[s / group_].data() + (s % group_) * bytes_);
  }
  ready_ = slots;
  made_ = std::move(made);
}

void StagingRing::StartMaking() {
  {
    MutexLock lock(mu_);
    if (ready_ == slots_) return;
    made_pins_.clear();
    made_pins_.resize(pins_);
    data_.assign(slots_, nullptr);
    started_at_ = std::chrono::steady_clock::now();
  }
  const size_t workers = std::min<size_t>(pins_, 8);
  for (size_t t = 0; t < workers; ++t) {
    makers_.emplace_back([this, t, workers] { Make(t, workers); });
  }
  MutexLock lock(mu_);
  while (contexts_set_ < workers) cv_.Wait(mu_);
}

Result<std::byte*> StagingRing::Wait(size_t slot) {
  MutexLock lock(mu_);
  while (error_.ok() && data_[slot] == nullptr) cv_.Wait(mu_);
  if (!error_.ok()) return error_;
  return data_[slot];
}

Result<std::vector<PinnedHostBuffer>> StagingRing::Finish() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  for (std::thread& t : makers_) t.join();
  makers_.clear();
  MutexLock lock(mu_);
  if (!error_.ok()) return error_;
  if (!made_.empty()) return std::move(made_);
  std::vector<PinnedHostBuffer> out;
  for (auto& pin : made_pins_) {
    if (!pin) return InternalError("staging ring finished before every slot was made");
    out.push_back(std::move(*pin));
  }
  made_pins_.clear();
  return out;
}

double StagingRing::seconds() const {
  MutexLock lock(mu_);
  return seconds_;
}

void StagingRing::Make(size_t t, size_t workers) {
  // cuMemHostRegister needs a current context on the calling thread.
  const CUresult rc = api_->cuCtxSetCurrent(context_);
  {
    MutexLock lock(mu_);
    if (rc != CUDA_SUCCESS) {
      FailLocked(DriverError(api_, rc, "cuCtxSetCurrent on a staging-allocation thread"));
    }
    ++contexts_set_;
  }
  cv_.NotifyAll();
  if (rc != CUDA_SUCCESS) return;
  for (size_t p = t; p < pins_; p += workers) {
    {
      MutexLock lock(mu_);
      if (stop_ || !error_.ok()) return;
    }
    const size_t first = p * group_;
    const size_t count = std::min(slots_ - first, group_);
    Result<PinnedHostBuffer> made = PinnedHostBuffer::Create(api_, count * bytes_);
    {
      MutexLock lock(mu_);
      if (!made.ok()) {
        FailLocked(made.status());
      } else {
        for (size_t k = 0; k < count; ++k) data_[first + k] = made->data() + k * bytes_;
        made_pins_[p].emplace(std::move(made).value());
        ready_ += count;
        if (ready_ == slots_) {
          seconds_ =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - started_at_).count();
        }
      }
    }
    cv_.NotifyAll();
  }
}

}  // namespace weightcache::cuda
