#include "daemon/budget.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "common/logging.h"
#include "common/strict_json.h"
#include "daemon/byte_size.h"
#include "identity/paths.h"
#include "os/ledger_file.h"
#include "os/lock_file.h"
#include "os/read_file.h"

namespace weightcache::daemon {
namespace {

// Far above any real ledger (an entry is ~250 bytes): a bigger file is not ours.
constexpr size_t kMaxLedgerBytes = size_t{4} << 20;
constexpr int kLedgerVersion = 1;

using Json = nlohmann::json;

// kIo, not kInvalidArgument: a damaged file of the device's state is a runtime condition (exit
// 1), never a usage error (exit 2) the command line could fix.
Status Corrupt(const std::string& path, const std::string& why) {
  return Status(StatusCode::kIo,
                "budget ledger " + path + " is corrupt (" + why +
                    "); no cache can be admitted on this device until it is fixed: "
                    "restore it, or stop the device's caches (`weightcache stop --all`), "
                    "remove it and start them again (a running cache is counted only by "
                    "the entry its admission wrote)");
}

// The unsigned integer at `key` of `object`, at most `max`.
Result<uint64_t> UnsignedField(const Json& object, const char* key, uint64_t max,
                               const std::string& path, size_t index) {
  const auto it = object.find(key);
  if (it == object.end() || !it->is_number_unsigned() || it->get<uint64_t>() > max) {
    return Corrupt(path, "entry " + std::to_string(index) + ": '" + key +
                             "' must be an unsigned integer up to " + std::to_string(max));
  }
  return it->get<uint64_t>();
}

Result<LedgerEntry> ParseEntry(const Json& e, const std::string& path, size_t index) {
  const std::string where = "entry " + std::to_string(index);
  if (!e.is_object()) return Corrupt(path, where + " is not an object");
  LedgerEntry entry;
  const auto socket = e.find("socket");
  if (socket == e.end() || !socket->is_string() || socket->get<std::string>().empty()) {
    return Corrupt(path, where + ": 'socket' must be a non-empty string");
  }
  entry.socket = socket->get<std::string>();
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      const uint64_t pid,
      UnsignedField(e, "pid", static_cast<uint64_t>(std::numeric_limits<pid_t>::max()), path,
                    index));
  if (pid == 0) return Corrupt(path, where + ": 'pid' must not be 0");
  entry.pid = static_cast<pid_t>(pid);
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      entry.pid_start_time,
      UnsignedField(e, "pid_start_time", std::numeric_limits<uint64_t>::max(), path, index));
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      entry.bytes, UnsignedField(e, "bytes", std::numeric_limits<uint64_t>::max(), path, index));
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      const uint64_t clients,
      UnsignedField(e, "clients", std::numeric_limits<uint32_t>::max(), path, index));
  entry.clients = static_cast<uint32_t>(clients);
  WEIGHTCACHE_ASSIGN_OR_RETURN(
      const uint64_t last_used,
      UnsignedField(e, "last_used_ms", static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                    path, index));
  entry.last_used_ms = static_cast<int64_t>(last_used);
  const auto tier = e.find("tier");
  const std::optional<Tier> parsed_tier =
      tier != e.end() && tier->is_string() ? ParseTier(tier->get<std::string>()) : std::nullopt;
  if (!parsed_tier) return Corrupt(path, where + ": 'tier' must be \"gpu\" or \"host\"");
  entry.tier = *parsed_tier;
  const auto pinned = e.find("pinned");
  if (pinned == e.end() || !pinned->is_boolean()) {
    return Corrupt(path, where + ": 'pinned' must be true or false");
  }
  entry.pinned = pinned->get<bool>();
  if (e.contains("budget")) {  // optional: absent in entries written before it existed
    WEIGHTCACHE_ASSIGN_OR_RETURN(
        entry.budget,
        UnsignedField(e, "budget", std::numeric_limits<uint64_t>::max(), path, index));
  }
  return entry;
}

std::string Describe(const LedgerEntry& e) {
  std::string text = e.socket + " " + FormatBytes(e.bytes) + " (pid " + std::to_string(e.pid) +
                     ", " + std::to_string(e.clients) + (e.clients == 1 ? " client" : " clients");
  if (e.pinned) text += ", pinned";
  // A daemon that died with its keeper holding the memory answers no Evict: say who holds it.
  if (!DaemonHolds(e) && KeptByKeeper(e)) {
    text += "; its daemon is gone and its keeper holds the memory: `weightcache stop --socket " +
            e.socket + "` drops it";
  }
  return text + ")";
}

}  // namespace

uint64_t Ledger::BytesOn(Tier tier, std::string_view except_socket) const {
  uint64_t total = 0;
  for (const LedgerEntry& e : entries) {
    if (e.tier == tier && e.socket != except_socket) total += e.bytes;
  }
  return total;
}

LedgerEntry* Ledger::Find(std::string_view socket) {
  for (LedgerEntry& e : entries) {
    if (e.socket == socket) return &e;
  }
  return nullptr;
}

Result<uint64_t> ProcessStartTime(pid_t pid) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  auto text = os::ReadSmallFile(path, 4096);
  if (!text.ok()) return text.status();
  // "pid (comm) state ppid …": comm may hold spaces and parentheses, so fields are counted
  // from the last ')'. The field after it is field 3; the start time is field 22.
  const size_t close = text->rfind(')');
  if (close == std::string::npos) return InternalError(path + " has no ')'");
  size_t pos = close + 1;
  for (int field = 3; field <= 22; ++field) {
    while (pos < text->size() && (*text)[pos] == ' ') ++pos;
    const size_t end = text->find(' ', pos);
    if (field == 3 && pos < text->size() && ((*text)[pos] == 'Z' || (*text)[pos] == 'X')) {
      // Exited, waiting for its parent to reap it: it holds no memory and serves nothing.
      return Status(StatusCode::kNotFound, "process " + std::to_string(pid) + " has exited");
    }
    if (field == 22) {
      const std::string value = text->substr(pos, end == std::string::npos ? end : end - pos);
      uint64_t start = 0;
      for (const char c : value) {
        if (c < '0' || c > '9') return InternalError(path + ": bad start time " + value);
        start = start * 10 + static_cast<uint64_t>(c - '0');
      }
      if (value.empty()) return InternalError(path + ": no start time");
      return start;
    }
    if (end == std::string::npos) return InternalError(path + " has fewer than 22 fields");
    pos = end;
  }
  return InternalError(path + ": unreachable");
}

bool KeptByKeeper(const LedgerEntry& entry) {
  return os::IsLockHeld(identity::LockPathFor(identity::KeeperSocketFor(entry.socket)));
}

bool DaemonHolds(const LedgerEntry& entry) {
  auto start = ProcessStartTime(entry.pid);
  if (!start.ok() ? start.status().code() != StatusCode::kNotFound
                  : *start == entry.pid_start_time) {
    return true;
  }
  return os::IsLockHeld(identity::LockPathFor(entry.socket));
}

bool OwnerAlive(const LedgerEntry& entry) { return DaemonHolds(entry) || KeptByKeeper(entry); }

std::string SerializeLedger(const Ledger& ledger) {
  Json entries = Json::array();
  for (const LedgerEntry& e : ledger.entries) {
    entries.push_back(
        {{"socket", e.socket},
         {"pid", static_cast<uint64_t>(e.pid)},
         {"pid_start_time", e.pid_start_time},
         {"bytes", e.bytes},
         {"tier", std::string(TierName(e.tier))},
         {"pinned", e.pinned},
         {"clients", e.clients},
         {"last_used_ms", static_cast<uint64_t>(std::max<int64_t>(0, e.last_used_ms))},
         {"budget", e.budget}});
  }
  return Json{{"version", kLedgerVersion}, {"entries", std::move(entries)}}.dump(1) + "\n";
}

Result<Ledger> ParseLedger(std::string_view text, const std::string& path) {
  Json doc;
  if (std::string error = ParseStrictJson(text, doc); !error.empty()) return Corrupt(path, error);
  if (!doc.is_object()) return Corrupt(path, "not a JSON object");
  const auto version = doc.find("version");
  if (version == doc.end() || !version->is_number_unsigned() ||
      version->get<uint64_t>() != kLedgerVersion) {
    return Corrupt(path, "'version' must be " + std::to_string(kLedgerVersion));
  }
  const auto entries = doc.find("entries");
  if (entries == doc.end() || !entries->is_array()) {
    return Corrupt(path, "'entries' must be an array");
  }
  Ledger ledger;
  for (size_t i = 0; i < entries->size(); ++i) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(LedgerEntry entry, ParseEntry((*entries)[i], path, i));
    if (ledger.Find(entry.socket) != nullptr) {
      return Corrupt(
          path, "entry " + std::to_string(i) + ": socket " + entry.socket + " is listed twice");
    }
    ledger.entries.push_back(std::move(entry));
  }
  return ledger;
}

Result<LedgerEntry> SelfEntry(std::string socket, uint64_t bytes, Tier tier, bool pinned) {
  LedgerEntry entry;
  entry.socket = std::move(socket);
  entry.pid = ::getpid();
  WEIGHTCACHE_ASSIGN_OR_RETURN(entry.pid_start_time, ProcessStartTime(entry.pid));
  entry.bytes = bytes;
  entry.tier = tier;
  entry.pinned = pinned;
  entry.last_used_ms = NowUnixMs();
  return entry;
}

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

BudgetLedger::BudgetLedger(const std::string& device_dir, BudgetLedgerOptions options)
    : path_(identity::BudgetLedgerPath(device_dir)),
      lock_path_(identity::BudgetLedgerLockPath(device_dir)),
      options_(std::move(options)) {}

Result<Ledger> BudgetLedger::Update(const std::function<Status(Ledger&)>& update) {
  WEIGHTCACHE_ASSIGN_OR_RETURN(const os::ExclusiveFileLock lock,
                               os::ExclusiveFileLock::Acquire(lock_path_));
  return UpdateLocked(update);
}

Result<Ledger> BudgetLedger::UpdateUntil(const std::function<Status(Ledger&)>& update,
                                         std::chrono::steady_clock::time_point lock_deadline) {
  auto lock = os::ExclusiveFileLock::AcquireUntil(lock_path_, lock_deadline);
  if (!lock.ok()) return Status(lock.status()).Context("the budget ledger " + path_);
  return UpdateLocked(update);
}

Result<Ledger> BudgetLedger::ReadOnly() const {
  Ledger ledger;
  auto text = os::ReadSmallFile(path_, kMaxLedgerBytes);
  if (text.ok()) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(ledger, ParseLedger(*text, path_));
  } else if (text.status().code() == StatusCode::kInvalidArgument) {
    return Corrupt(path_, text.status().message());
  } else if (text.status().code() != StatusCode::kNotFound) {
    return Status(text.status()).Context("reading the budget ledger");
  }
  std::erase_if(ledger.entries, [](const LedgerEntry& e) { return !OwnerAlive(e); });
  return ledger;
}

Result<Ledger> BudgetLedger::UpdateLocked(const std::function<Status(Ledger&)>& update,
                                          std::vector<LedgerEntry>* dropped) {
  Ledger ledger;
  std::string before;
  auto text = os::ReadSmallFile(path_, kMaxLedgerBytes);
  if (text.ok()) {
    WEIGHTCACHE_ASSIGN_OR_RETURN(ledger, ParseLedger(*text, path_));
    before = SerializeLedger(ledger);
  } else if (text.status().code() == StatusCode::kInvalidArgument) {
    return Corrupt(path_, text.status().message());  // too large, or not a regular file
  } else if (text.status().code() != StatusCode::kNotFound) {
    return Status(text.status()).Context("reading the budget ledger");
  }
  std::erase_if(ledger.entries, [dropped](const LedgerEntry& e) {
    if (OwnerAlive(e)) return false;
    if (dropped != nullptr) dropped->push_back(e);
    return true;
  });
  WEIGHTCACHE_RETURN_IF_ERROR(update(ledger));
  const std::string after = SerializeLedger(ledger);
  if (after == before) return ledger;
  if (options_.before_write) options_.before_write();
  WEIGHTCACHE_RETURN_IF_ERROR(os::WriteFileAtomically(path_, after));
  return ledger;
}

Result<Ledger> BudgetLedger::Read() {
  return Update([](Ledger&) { return Status::Ok(); });
}

Result<std::vector<LedgerEntry>> BudgetLedger::ReclaimDead() {
  std::vector<LedgerEntry> dropped;
  std::error_code ec;
  if (!std::filesystem::exists(path_, ec)) return dropped;
  WEIGHTCACHE_ASSIGN_OR_RETURN(const os::ExclusiveFileLock lock,
                               os::ExclusiveFileLock::Acquire(lock_path_));
  WEIGHTCACHE_RETURN_IF_ERROR(
      UpdateLocked([](Ledger&) { return Status::Ok(); }, &dropped).status());
  return dropped;
}

Status BudgetLedger::Put(const LedgerEntry& entry) {
  return Update([&entry](Ledger& ledger) {
           if (LedgerEntry* mine = ledger.Find(entry.socket)) {
             *mine = entry;
           } else {
             ledger.entries.push_back(entry);
           }
           return Status::Ok();
         })
      .status();
}

Status BudgetLedger::Remove(std::string_view socket) {
  return Update([socket](Ledger& ledger) {
           std::erase_if(ledger.entries,
                         [socket](const LedgerEntry& e) { return e.socket == socket; });
           return Status::Ok();
         })
      .status();
}

LedgerClientsWriter::LedgerClientsWriter(BudgetLedger& ledger, std::string socket,
                                         std::chrono::milliseconds lock_wait,
                                         std::chrono::milliseconds retry)
    : ledger_(ledger),
      socket_(std::move(socket)),
      lock_wait_(lock_wait),
      retry_(retry),
      thread_([this] { Loop(); }) {}

LedgerClientsWriter::~LedgerClientsWriter() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void LedgerClientsWriter::Set(uint32_t clients) {
  {
    MutexLock lock(mu_);
    pending_ = Pending{clients, NowUnixMs()};
  }
  cv_.notify_all();
}

void LedgerClientsWriter::Loop() {
  const pid_t self = ::getpid();
  bool failing = false;
  for (;;) {
    Pending next;
    {
      MutexLock lock(mu_);
      while (!stop_ && !pending_.has_value()) cv_.wait(mu_);
      if (stop_) return;
      next = *pending_;
      pending_.reset();
    }
    auto written = ledger_.UpdateUntil(
        [&](Ledger& now) {
          LedgerEntry* mine = now.Find(socket_);
          if (mine != nullptr && mine->pid == self) {
            mine->clients = next.clients;
            mine->last_used_ms = next.at_ms;
          }
          return Status::Ok();
        },
        std::chrono::steady_clock::now() + lock_wait_);
    if (written.ok()) {
      if (failing) {
        LOG_INFO << "budget ledger updated again: " << next.clients << " client(s)";
      }
      failing = false;
      continue;
    }
    if (!failing) {
      LOG_WARN << "could not update the budget ledger (" << next.clients
               << " client(s); retrying every " << std::chrono::duration<double>(retry_).count()
               << " s): " << written.status().ToString();
    }
    failing = true;
    MutexLock lock(mu_);
    if (!pending_.has_value()) pending_ = next;  // a newer count wins
    const auto retry_at = std::chrono::steady_clock::now() + retry_;
    while (!stop_ && cv_.wait_until(mu_, retry_at) == std::cv_status::no_timeout) {
    }
    if (stop_) return;
  }
}

AdmissionPlan PlanAdmission(const Ledger& ledger, Tier tier, uint64_t budget, uint64_t need,
                            std::string_view self_socket) {
  AdmissionPlan plan;
  plan.held = ledger.BytesOn(tier, self_socket);
  std::vector<LedgerEntry> evictable;
  for (const LedgerEntry& e : ledger.entries) {
    if (e.tier == tier && e.socket != self_socket && e.clients == 0 && !e.pinned) {
      evictable.push_back(e);
    }
  }
  std::stable_sort(
      evictable.begin(), evictable.end(),
      [](const LedgerEntry& a, const LedgerEntry& b) { return a.last_used_ms < b.last_used_ms; });
  uint64_t held = plan.held;
  for (const LedgerEntry& victim : evictable) {
    if (need <= budget && held <= budget - need) break;
    held -= victim.bytes;
    plan.victims.push_back(victim);
  }
  if (need <= budget && held <= budget - need) {
    plan.fits = true;
    return plan;
  }
  plan.victims.clear();
  std::string holders;
  for (const LedgerEntry& e : ledger.entries) {
    if (e.tier != tier || e.socket == self_socket) continue;
    holders += (holders.empty() ? "" : "; ") + Describe(e);
  }
  plan.refusal = "the " + std::string(TierName(tier)) + " budget is " + FormatBytes(budget) +
                 "; this cache needs " + FormatBytes(need) + ", " + FormatBytes(plan.held) +
                 " is held and nothing more can be freed (only caches " +
                 "with no clients and not pinned are evicted)" +
                 (holders.empty() ? std::string() : ": held by " + holders);
  return plan;
}

Result<BudgetConfig> ReadBudgetConfig(const std::string& path) {
  constexpr size_t kMaxConfigBytes = 64 << 10;
  BudgetConfig config;
  auto text = os::ReadSmallFile(path, kMaxConfigBytes);
  if (!text.ok()) {
    if (text.status().code() == StatusCode::kNotFound) return config;
    return Status(text.status()).Context("reading the budget config");
  }
  auto trim = [](std::string_view s) {
    const size_t b = s.find_first_not_of(" \t\r");
    if (b == std::string_view::npos) return std::string_view();
    const size_t e = s.find_last_not_of(" \t\r");
    return s.substr(b, e - b + 1);
  };
  std::string_view rest = *text;
  int line_no = 0;
  while (!rest.empty()) {
    const size_t nl = rest.find('\n');
    std::string_view line = rest.substr(0, nl);
    rest = nl == std::string_view::npos ? std::string_view() : rest.substr(nl + 1);
    ++line_no;
    if (const size_t hash = line.find('#'); hash != std::string_view::npos) {
      line = line.substr(0, hash);
    }
    line = trim(line);
    if (line.empty()) continue;
    const size_t eq = line.find('=');
    const std::string where = path + " line " + std::to_string(line_no);
    if (eq == std::string_view::npos) {
      return InvalidArgument(where + ": expected `key = value`, got '" + std::string(line) + "'");
    }
    const std::string_view key = trim(line.substr(0, eq));
    const std::string value(trim(line.substr(eq + 1)));
    if (value.empty()) return InvalidArgument(where + ": " + std::string(key) + " has no value");
    if (key == "gpu_budget") {
      config.gpu_budget = value;
    } else if (key == "host_budget") {
      config.host_budget = value;
    } else {
      return InvalidArgument(where + ": unknown key '" + std::string(key) +
                             "' (known: gpu_budget, host_budget)");
    }
  }
  return config;
}

namespace {

// Whether the owner of `victim` is gone, or goes within `grace`: a daemon killed in the middle
// of an Evict closes its connection before its exit is complete (its files are released, the
// GPU driver's among them, before it becomes a zombie).
bool OwnerGoneWithin(const LedgerEntry& victim, std::chrono::milliseconds grace) {
  const auto until = std::chrono::steady_clock::now() + grace;
  for (;;) {
    if (!OwnerAlive(victim)) return true;
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace

Status AdmitEvicting(BudgetLedger& ledger, const LedgerEntry& self, uint64_t budget,
                     const EvictFn& evict, std::chrono::steady_clock::time_point deadline) {
  const std::string tier(TierName(self.tier));
  // Each round evicts at least one cache or ends; the bound only stops a livelock with caches
  // that keep coming back.
  constexpr int kMaxRounds = 16;
  for (int round = 0; round < kMaxRounds; ++round) {
    AdmissionPlan plan;
    // Every wait for the ledger's lock ends at the deadline: a peer hung inside its critical
    // section must not hold an admission (a promotion's, on the mover thread, which a stop
    // joins) past it.
    auto planned = ledger.UpdateUntil(
        [&](Ledger& now) {
          plan = PlanAdmission(now, self.tier, budget, self.bytes, self.socket);
          if (!plan.fits) return Status(StatusCode::kOutOfMemory, plan.refusal);
          if (!plan.victims.empty()) return Status::Ok();  // nothing changes under this lock
          if (LedgerEntry* mine = now.Find(self.socket)) {
            *mine = self;
          } else {
            now.entries.push_back(self);
          }
          return Status::Ok();
        },
        deadline);
    if (!planned.ok()) return planned.status();
    if (plan.victims.empty()) return Status::Ok();  // registered

    // Outside the lock: each victim decides on its own state (it may have gained a client).
    std::vector<LedgerEntry> going;
    std::string refused;
    for (const LedgerEntry& v : plan.victims) {
      Result<EvictAnswer> answer =
          evict ? evict(v) : EvictAnswer{.accepted = false, .reason = "no eviction"};
      if (answer.ok() && answer->accepted) {
        LOG_INFO << "evicting " << Describe(v) << " to make room for " << FormatBytes(self.bytes);
        going.push_back(v);
      } else if (answer.ok()) {
        refused += (refused.empty() ? "" : "; ") + Describe(v) + ": refused: " + answer->reason;
      } else if (OwnerGoneWithin(v, kVictimExitGrace)) {
        // No answer because it died (killed in the middle of the Evict, crashed): its memory
        // goes with it, and the next read reclaims its entry (found on the H200 by
        // scripts/gpu-budget.sh step 5: the newcomer gave up instead).
        LOG_INFO << Describe(v) << " died without answering the Evict ("
                 << answer.status().message() << "): its entry is reclaimed";
        going.push_back(v);
      } else {
        refused += (refused.empty() ? "" : "; ") + Describe(v) + ": " + answer.status().message();
      }
    }
    if (going.empty()) {
      return Status(StatusCode::kOutOfMemory,
                    "the " + tier + " budget is " + FormatBytes(budget) + "; this cache needs " +
                        FormatBytes(self.bytes) + ", " + FormatBytes(plan.held) +
                        " is held, and no idle cache gave its memory back (" + refused + ")");
    }
    // Each evicted daemon removes its entry once its memory is freed (a killed one is
    // reclaimed by the read), or moves it to the host tier once demoted (`serve --demote
    // host`): wait for that, then plan again.
    for (;;) {
      WEIGHTCACHE_ASSIGN_OR_RETURN(
          Ledger now, ledger.UpdateUntil([](Ledger&) { return Status::Ok(); }, deadline));
      const bool gone = std::ranges::none_of(going, [&](const LedgerEntry& v) {
        const LedgerEntry* e = now.Find(v.socket);
        return e != nullptr && e->pid == v.pid && e->tier == self.tier;
      });
      if (gone) break;
      if (std::chrono::steady_clock::now() > deadline) {
        return Status(StatusCode::kTimeout,
                      "evicted caches did not give their memory back in time: " +
                          Describe(going.front()) + " still holds it");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  return Status(StatusCode::kOutOfMemory, "the " + tier + " budget is " + FormatBytes(budget) +
                                              ": no room after " + std::to_string(kMaxRounds) +
                                              " rounds of eviction (caches keep arriving)");
}

}  // namespace weightcache::daemon
