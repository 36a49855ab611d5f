#include "daemon/fd_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <utility>

#include "common/logging.h"
#include "os/memfd.h"
#include "protocol/frame.h"
#include "protocol/handoff.h"

#ifdef WEIGHTCACHE_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

namespace weightcache::daemon {
namespace {

// A deposit description is a frame header and a DepositInfo payload (its config JSON bounded
// by the frame's payload limit); anything larger is not one.
constexpr uint64_t kMaxDepositDescription = 1 << 20;

#ifdef WEIGHTCACHE_HAVE_SYSTEMD
class SystemdServiceManager final : public ServiceManager {
 public:
  Status Notify(std::string_view state, std::span<const int> fds) override {
    const std::string text(state);
    const int rc = fds.empty()
                       ? ::sd_pid_notify(0, /*unset_environment=*/0, text.c_str())
                       : ::sd_pid_notify_with_fds(0, /*unset_environment=*/0, text.c_str(),
                                                  fds.data(), static_cast<unsigned>(fds.size()));
    if (rc < 0) return IoError("sd_notify " + FirstLine(text), -rc);
    if (rc == 0) return Status(StatusCode::kUnavailable, "sd_notify: NOTIFY_SOCKET is not set");
    return Status::Ok();
  }

 private:
  static std::string FirstLine(const std::string& text) { return text.substr(0, text.find('\n')); }
};
#endif

// The sealed memfd holding a deposit's description (the Deposit frame, header and payload).
Result<UniqueFd> DescriptionMemfd(const std::vector<uint8_t>& frame) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(UniqueFd fd, os::CreateMemfd("weightcache-deposit", frame.size()));
  {
    WEIGHTCACHE_ASSIGN_OR_RETURN(os::MappedRegion map, os::MapReadWrite(fd.get(), frame.size()));
    std::memcpy(map.data(), frame.data(), frame.size());
  }
  WEIGHTCACHE_RETURN_IF_ERROR(os::SealReadOnly(fd.get()));
  return fd;
}

// The Deposit frame the named fds make up: the description read from wc-deposit (sealed, of
// bounded size, a valid Deposit header whose payload is the rest), then wc-manifest and
// wc-alloc-0.. as its fds. Unknown names are closed; a duplicate or missing name is an error.
Result<protocol::Frame> FrameFromNamedFds(std::vector<NamedFd> named, size_t* max_allocations) {
  std::map<std::string, UniqueFd> by_name;
  for (NamedFd& n : named) {
    const bool ours =
        n.name == kFdNameDeposit || n.name == kFdNameManifest || n.name.rfind("wc-alloc-", 0) == 0;
    if (!ours) {
      LOG_WARN << "closing fd " << n.fd.get() << " passed by the service manager as '" << n.name
               << "' (not a weightcache name)";
      continue;
    }
    if (by_name.count(n.name) != 0) {
      return ProtocolError("the service manager passed '" + n.name + "' twice");
    }
    by_name.emplace(n.name, std::move(n.fd));
  }
  *max_allocations = by_name.size();
  auto description = by_name.find(std::string(kFdNameDeposit));
  if (description == by_name.end()) {
    return ProtocolError("no '" + std::string(kFdNameDeposit) + "' among the passed fds");
  }
  const int desc_fd = description->second.get();
  Status sealed = os::CheckSealedReadOnly(desc_fd);
  if (!sealed.ok()) return sealed.Context(std::string(kFdNameDeposit));
  WEIGHTCACHE_ASSIGN_OR_RETURN(uint64_t size, os::FileSize(desc_fd));
  if (size < protocol::kFrameHeaderSize || size > kMaxDepositDescription) {
    return ProtocolError(std::string(kFdNameDeposit) + " is " + std::to_string(size) +
                         " bytes, not a deposit description");
  }
  WEIGHTCACHE_ASSIGN_OR_RETURN(os::MappedRegion map, os::MapReadOnly(desc_fd, size));
  const std::span<const uint8_t> bytes(static_cast<const uint8_t*>(map.data()), size);
  auto header = protocol::DecodeFrameHeader(bytes, protocol::Expect::kKeeperRequest);
  if (!header.ok()) {
    Status status = header.status();
    return status.Context(std::string(kFdNameDeposit));
  }
  if (header->type != protocol::MessageType::kDeposit ||
      header->payload_length != size - protocol::kFrameHeaderSize) {
    return ProtocolError(std::string(kFdNameDeposit) + " holds a " +
                         protocol::MessageTypeName(header->type) + " of " +
                         std::to_string(header->payload_length) + " payload bytes in " +
                         std::to_string(size) + " bytes, not a Deposit");
  }
  protocol::Frame frame;
  frame.type = protocol::MessageType::kDeposit;
  frame.payload.assign(bytes.begin() + protocol::kFrameHeaderSize, bytes.end());
  if (header->fd_count < 1 || header->fd_count != by_name.size() - 1) {
    return ProtocolError(std::string(kFdNameDeposit) + " describes " +
                         std::to_string(header->fd_count) + " fds, the service manager passed " +
                         std::to_string(by_name.size() - 1));
  }
  for (uint32_t i = 0; i < header->fd_count; ++i) {
    const std::string name = i == 0 ? std::string(kFdNameManifest) : FdNameAllocation(i - 1);
    auto it = by_name.find(name);
    if (it == by_name.end()) return ProtocolError("no '" + name + "' among the passed fds");
    frame.fds.push_back(std::move(it->second));
  }
  return frame;
}

}  // namespace

bool BuiltWithSystemd() {
#ifdef WEIGHTCACHE_HAVE_SYSTEMD
  return true;
#else
  return false;
#endif
}

std::string FdNameAllocation(size_t index) { return "wc-alloc-" + std::to_string(index); }

Result<std::optional<ServiceEnvironment>> ServiceManagerFromEnvironment() {
  const char* notify = std::getenv("NOTIFY_SOCKET");
  if (notify == nullptr || notify[0] == '\0') return std::optional<ServiceEnvironment>();
#ifdef WEIGHTCACHE_HAVE_SYSTEMD
  ServiceEnvironment env;
  env.manager = std::make_shared<SystemdServiceManager>();
  char** names = nullptr;
  const int n = ::sd_listen_fds_with_names(/*unset_environment=*/1, &names);
  if (n < 0) {
    // Malformed LISTEN_* variables: nothing to adopt, the daemon loads (and still notifies).
    LOG_WARN << IoError("sd_listen_fds_with_names", -n).ToString() << "; no fds adopted";
  }
  for (int i = 0; i < n; ++i) {
    const int fd = SD_LISTEN_FDS_START + i;
    const std::string name = names != nullptr && names[i] != nullptr ? names[i] : "unknown";
    env.listened.push_back(NamedFd{name, UniqueFd(fd)});
  }
  if (names != nullptr) {
    for (int i = 0; names[i] != nullptr; ++i) std::free(names[i]);  // NOLINT(*-no-malloc)
    std::free(static_cast<void*>(names));                           // NOLINT(*-no-malloc)
  }
  return std::optional<ServiceEnvironment>(std::move(env));
#else
  return Status(StatusCode::kUnavailable,
                "NOTIFY_SOCKET is set but this weightcache was built without systemd "
                "(WEIGHTCACHE_SYSTEMD=OFF, or no libsystemd at build time): no sd_notify, no fd "
                "store");
#endif
}

std::optional<AdoptedStore> FdStore::Adopt(const identity::CacheConfig& config,
                                           const std::string& model_path,
                                           const KeeperLinkOptions& verify,
                                           const GpuAdoptContext* gpu) {
  if (env_.listened.empty()) return std::nullopt;
  std::vector<NamedFd> named = std::move(env_.listened);
  env_.listened.clear();
  auto reject = [&](const Status& why) -> std::optional<AdoptedStore> {
    LOG_WARN << "not adopting the cache from the service manager's fd store: " << why.ToString()
             << "; removing it from the store and loading from the checkpoint";
    Status removed = Remove();
    if (!removed.ok()) {
      LOG_WARN << "FDSTOREREMOVE failed: " << removed.ToString();
    }
    return std::nullopt;
  };
  auto frame = FrameFromNamedFds(std::move(named), &max_allocations_);
  if (!frame.ok()) return reject(frame.status());
  protocol::FdCheck gpu_fd_check = [](int fd, uint64_t /*size*/, uint32_t index) -> Status {
    if (::fcntl(fd, F_GETFD) < 0) {
      return ProtocolError(FdNameAllocation(index) + " is not an open fd");
    }
    return Status::Ok();
  };
  auto handoff = protocol::DecodeHandoff(std::move(frame).value(), gpu_fd_check);
  if (!handoff.ok()) return reject(handoff.status());
  std::string timings;
  Status valid = ValidateKeptHandoff(*handoff, config, model_path, verify, gpu, &timings);
  if (!valid.ok()) return reject(valid);
  protocol::AdoptOptions adopt;
  adopt.checksums = verify.verify;
  adopt.sample_tensors = verify.sample_tensors;
  std::string verified = DescribeVerified(adopt, handoff->manifest.tensor_count());
  const int64_t depositor = handoff->info.depositor_pid;
  // Verified before ready, whatever --adopt-verify says (behind is the keeper's only).
  return AdoptedStore{StoreFromHandoff(std::move(handoff).value()),
                      /*keeper_pid=*/0,
                      depositor,
                      std::move(verified),
                      std::move(timings),
                      /*verify_behind=*/std::nullopt};
}

Status FdStore::Deposit(const identity::CacheConfig& config, const WeightStore& store) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<uint8_t> frame,
                               protocol::EncodeDeposit(DescribeStore(config, store)));
  WEIGHTCACHE_ASSIGN_OR_RETURN(UniqueFd description, DescriptionMemfd(frame));
  const std::vector<int> fds = store.fds();
  max_allocations_ = std::max(max_allocations_, fds.size());
  auto put = [this](std::string_view name, int fd) -> Status {
    const int one[] = {fd};
    Status sent =
        env_.manager->Notify("FDSTORE=1\nFDNAME=" + std::string(name), std::span<const int>(one));
    if (!sent.ok()) return sent.Context("depositing '" + std::string(name) + "' in the fd store");
    return Status::Ok();
  };
  WEIGHTCACHE_RETURN_IF_ERROR(put(kFdNameDeposit, description.get()));
  WEIGHTCACHE_RETURN_IF_ERROR(put(kFdNameManifest, store.summary().manifest.fd.get()));
  for (size_t i = 0; i < fds.size(); ++i) {
    WEIGHTCACHE_RETURN_IF_ERROR(put(FdNameAllocation(i), fds[i]));
  }
  return Status::Ok();
}

Status FdStore::Remove(size_t allocations) {
  max_allocations_ = std::max(max_allocations_, allocations);
  Status first = Status::Ok();
  auto remove = [&](std::string_view name) {
    Status sent = env_.manager->Notify("FDSTOREREMOVE=1\nFDNAME=" + std::string(name), {});
    if (!sent.ok() && first.ok()) first = std::move(sent);
  };
  remove(kFdNameDeposit);
  remove(kFdNameManifest);
  for (size_t i = 0; i < max_allocations_; ++i) remove(FdNameAllocation(i));
  return first;
}

}  // namespace weightcache::daemon
