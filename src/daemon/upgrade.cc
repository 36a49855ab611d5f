#include "daemon/upgrade.h"

#include <fcntl.h>
#include <unistd.h>

#include <utility>
#include <vector>

#include "protocol/connection.h"
#include "protocol/frame.h"
#include "protocol/handoff.h"
#include "protocol/messages.h"

namespace weightcache::daemon {

Status SendHandover(int channel, const identity::CacheConfig& config, const WeightStore& store,
                    int lock_fd, std::chrono::milliseconds timeout) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> frame,
                               protocol::EncodeHandover(DescribeStore(config, store)));
  std::vector<int> fds;
  fds.reserve(store.fds().size() + 2);
  fds.push_back(store.summary().manifest.fd.get());
  for (int fd : store.fds()) fds.push_back(fd);
  fds.push_back(lock_fd);
  Status sent = protocol::WriteFrame(channel, frame, fds, os::Deadline::After(timeout));
  if (!sent.ok()) return sent.Context("sending the handover to the successor");
  return Status::Ok();
}

Result<TakenOver> ReceiveHandover(int channel, const identity::CachePaths& paths,
                                  const identity::CacheConfig& config,
                                  const std::string& model_path, const KeeperLinkOptions& verify,
                                  const GpuAdoptContext* gpu, std::chrono::milliseconds timeout) {
  auto frame =
      protocol::ReadFrame(channel, protocol::Expect::kKeeperRequest, os::Deadline::After(timeout));
  if (!frame.ok()) {
    Status status = frame.status();
    return status.Context("reading the handover");
  }
  if (frame->type != protocol::MessageType::kHandover) {
    return ProtocolError("expected a Handover on the upgrade channel, got " +
                         protocol::MessageTypeName(frame->type));
  }
  const bool gpu_tier = config.tier == Tier::kGpu;
  if (gpu_tier && (gpu == nullptr || gpu->driver == nullptr)) {
    return InternalError("gpu tier: no CUDA driver to check the handed-over allocations");
  }
  // Gpu tier: a VMM fd says nothing about itself without the driver; VerifyGpuHandoff below
  // imports each one (which checks it is an allocation of this device of its size).
  protocol::FdCheck gpu_fd_check = [](int fd, uint64_t /*size*/, uint32_t index) -> Status {
    if (::fcntl(fd, F_GETFD) < 0) {
      return ProtocolError("handed-over allocation " + std::to_string(index) +
                           " is not an open fd");
    }
    return Status::Ok();
  };
  WEIGHTCACHE_ASSIGN_OR_RETURN(protocol::Handoff handoff,
                               protocol::DecodeHandoff(std::move(frame).value(), gpu_fd_check));
  protocol::AdoptOptions adopt;
  adopt.expected_digest = config.Digest();
  adopt.checksums = verify.verify;
  adopt.sample_tensors = verify.sample_tensors;
  if (handoff.info.config_digest != adopt.expected_digest) {
    return Status(StatusCode::kMismatch,
                  "the daemon hands over cache " + handoff.info.config_digest +
                      ", this successor computes " + adopt.expected_digest +
                      " from the same flags (a changed checkpoint, or a build that derives "
                      "the identity otherwise)");
  }
  // The digest first: a successor that computes another identity (a changed checkpoint, other
  // flags, a build that derives it otherwise) has other paths, the lock file included.
  auto lock = os::LockFile::Adopt(std::move(handoff.lock), paths.lock);
  if (!lock.ok()) return lock.status();
  // The checkpoint as it is now and the checksums: the keeper's and the fd store's one check.
  WEIGHTCACHE_RETURN_IF_ERROR(
      ValidateKeptHandoff(handoff, config, model_path, verify, gpu_tier ? gpu : nullptr));
  const std::string verified = DescribeVerified(adopt, handoff.manifest.tensor_count());
  const int64_t predecessor = handoff.info.depositor_pid;
  return TakenOver{std::move(lock).value(), StoreFromHandoff(std::move(handoff)), predecessor,
                   verified};
}

Status ConfirmHandover(int channel) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> frame,
                               protocol::EncodeEmptyHandoff(protocol::MessageType::kHandoverDone));
  return protocol::WriteFrame(channel, frame, {}, os::Deadline::After(std::chrono::seconds(5)));
}

void RefuseHandover(int channel, const Status& why) {
  auto frame = protocol::EncodeError(why);
  if (frame.ok()) {
    (void)protocol::WriteFrame(channel, *frame, {}, os::Deadline::After(std::chrono::seconds(5)));
  }
}

}  // namespace weightcache::daemon
