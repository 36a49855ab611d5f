#include "fleet/registrar.h"

#include <algorithm>
#include <utility>

#include "common/logging.h"

namespace weightcache::fleet {

using Clock = std::chrono::steady_clock;

Result<std::unique_ptr<Registrar>> Registrar::Create(EtcdClient client, RegistrarOptions options) {
  WEIGHTCACHE_RETURN_IF_ERROR(ValidatePrefix(options.prefix));
  if (options.ttl < std::chrono::seconds(1)) {
    return InvalidArgument("registry TTL must be at least 1 s");
  }
  if (options.min_backoff <= std::chrono::milliseconds::zero()) {
    return InvalidArgument("registry backoff must be positive");
  }
  return std::unique_ptr<Registrar>(new Registrar(std::move(client), std::move(options)));
}

Registrar::~Registrar() { Stop(); }

Status Registrar::Publish(RegistryEntry entry) {
  WEIGHTCACHE_RETURN_IF_ERROR(entry.Validate());
  const std::string key = EntryKey(options_.prefix, entry);
  {
    MutexLock lock(mu_);
    if (withdraw_) return Status::Ok();
    if (!key_.empty() && key != key_) {
      return InvalidArgument("registry entry key " + key + " differs from the registered " + key_);
    }
    key_ = key;
    entry_ = std::move(entry);
    ++version_;
    if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
  }
  wake_.notify_all();
  return Status::Ok();
}

void Registrar::Withdraw() {
  {
    MutexLock lock(mu_);
    withdraw_ = true;
  }
  wake_.notify_all();
}

void Registrar::Stop() {
  std::thread thread;
  {
    MutexLock lock(mu_);
    withdraw_ = true;
    thread = std::move(thread_);
  }
  wake_.notify_all();
  if (thread.joinable()) thread.join();
}

void Registrar::Run() {
  const auto ttl = std::chrono::duration_cast<std::chrono::milliseconds>(options_.ttl);
  const auto renew_every = std::max(ttl / 3, std::chrono::milliseconds(100));
  const auto max_backoff = std::max(options_.min_backoff, renew_every);
  auto backoff = options_.min_backoff;

  int64_t lease = 0;
  uint64_t done_version = 0;  // the version etcd holds under `lease`
  Clock::time_point last_renewed;
  Clock::time_point wake_at = Clock::now();
  bool failing = false;  // in an outage: said once, and when it ends
  bool registered_once = false;

  for (;;) {
    RegistryEntry entry;
    std::string key;
    uint64_t version = 0;
    {
      MutexLock lock(mu_);
      while (!withdraw_ && version_ == done_version && Clock::now() < wake_at) {
        wake_.wait_until(mu_, wake_at);
      }
      if (withdraw_) break;
      entry = entry_;
      key = key_;
      version = version_;
    }

    Status step;
    const auto now = Clock::now();
    if (lease == 0) {
      auto granted = client_.LeaseGrant(options_.ttl.count());
      if (granted.ok()) {
        step = client_.Put(key, entry.ToJsonText(), *granted);
        if (step.ok()) {
          lease = *granted;
          lease_ = lease;
          done_version = version;
          last_renewed = now;
          LOG_INFO << "registry: " << (registered_once ? "registered again " : "registered ") << key
                   << " (" << EntryStateName(entry.state) << ", lease " << lease << ", TTL "
                   << options_.ttl.count() << " s)";
          registered_once = true;
        } else {
          (void)client_.LeaseRevoke(*granted);  // best effort; it expires anyway
        }
      } else {
        step = granted.status();
      }
    } else if (version != done_version) {
      step = client_.Put(key, entry.ToJsonText(), lease);
      if (step.ok()) {
        done_version = version;
        LOG_DEBUG << "registry: " << key << " is now " << EntryStateName(entry.state);
      }
    } else {
      auto renewed = client_.LeaseKeepAlive(lease);
      if (renewed.ok()) {
        last_renewed = now;
      } else {
        step = renewed.status();
      }
    }

    if (!step.ok() && lease != 0 && step.code() == StatusCode::kNotFound) {
      // etcd says the lease is gone (it expired while etcd was out of reach, or was revoked):
      // its entry went with it. Register afresh, at once. An unreachable etcd is no such
      // answer: an etcd restarted on its data dir keeps its leases (and extends them), so the
      // lease is renewed as it is once etcd answers again, and revoked at Stop.
      LOG_WARN << "registry: the lease of " << key << " is lost (" << step.message()
               << "); registering again";
      lease = 0;
      lease_ = 0;
      wake_at = Clock::now();
      continue;
    }
    if (!step.ok()) {
      if (!failing) {
        LOG_WARN << "registry: " << step.ToString() << "; the cache serves on, retrying";
      } else {
        LOG_DEBUG << "registry: " << step.ToString();
      }
      failing = true;
      wake_at = Clock::now() + backoff;
      backoff = std::min(backoff * 2, max_backoff);
      continue;
    }
    if (failing) {
      LOG_INFO << "registry: reachable again";
    }
    failing = false;
    backoff = options_.min_backoff;
    wake_at = last_renewed + renew_every;
  }

  if (lease != 0) {
    Status revoked = client_.LeaseRevoke(lease);
    if (!revoked.ok()) {
      LOG_WARN << "registry: revoking lease " << lease << ": " << revoked.ToString()
               << " (the entry expires within the TTL)";
    } else {
      LOG_INFO << "registry: withdrawn";
    }
    lease_ = 0;
  }
}

}  // namespace weightcache::fleet
