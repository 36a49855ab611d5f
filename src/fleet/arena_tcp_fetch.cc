// The host-memory fill: FetchArena over the weightcache-native TCP protocol
// (arena_transfer_hello.h has the frames). One thread (the caller's) polls every source's
// connection. Each source is connected at once; reading starts as soon as one source has passed
// its hello and accept() (after a short window in which the others may join), and a source that
// answers later joins the striping then. Each source's connection carries up to
// max_in_flight_per_source read requests at once, answered in order, so that a round trip is
// never the limit. The filler opens no listening socket.
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <optional>
#include <vector>

#include "common/logging.h"
#include "common/unique_fd.h"
#include "fleet/arena_transfer_hello.h"
#include "fleet/arena_transfer_internal.h"
#include "os/tcp_socket.h"

namespace weightcache::fleet {
namespace tcp_fetch_detail {

using Clock = std::chrono::steady_clock;
constexpr int kPollMs = 10;
// Once the first source is ready, how long reading waits for the others still taking their
// hellos (so that a fetch from several healthy sources stripes across all of them from the
// start); a source that answers later still joins. Far below any connect_timeout.
constexpr auto kGatherWindow = std::chrono::milliseconds(100);

double Millis(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

struct Stripe {
  size_t region = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

enum class Phase { kConnecting, kHello, kReady, kDropped, kUnused };

struct Source {
  std::string endpoint;
  Phase phase = Phase::kConnecting;
  UniqueFd fd;
  Status why;  // set when dropped or left unused
  Clock::time_point connect_started;
  std::vector<uint8_t> header = std::vector<uint8_t>(kHelloHeaderBytes);
  std::vector<uint8_t> body;
  size_t have = 0;  // bytes of the header, then of the body
  bool header_done = false;
  std::vector<uint8_t> out;  // requests not yet sent
  size_t out_sent = 0;
  std::deque<size_t> in_flight;  // stripes requested, answered in this order
  uint64_t received_of_front = 0;
  Clock::time_point last_progress;
  uint64_t bytes = 0;
  bool used = false;
};

bool Transient(int error) { return error == EAGAIN || error == EWOULDBLOCK || error == EINTR; }

class TcpFetch {
 public:
  explicit TcpFetch(const FetchOptions& options) : options_(options) {}

  Result<FetchResult> Run() {
    const auto start = Clock::now();
    deadline_ = start + options_.deadline;
    PlanStripes();
    sources_.resize(options_.sources.size());
    for (size_t i = 0; i < sources_.size(); ++i) {
      // Resolving a name can block for the resolver's timeout: a stop or the deadline is
      // honoured between sources.
      if (Cancelled()) return Failure(StatusCode::kUnavailable, "cancelled");
      if (Clock::now() >= deadline_) {
        return Failure(StatusCode::kTimeout, "the fetch passed its deadline while connecting");
      }
      Connect(i);
    }
    WEIGHTCACHE_RETURN_IF_ERROR(Loop());
    const auto end = Clock::now();
    for (Source& source : sources_) {
      if (source.phase != Phase::kConnecting && source.phase != Phase::kHello) continue;
      // Still connecting when every byte was in: it is not waited for.
      source.phase = Phase::kUnused;
      source.why = Status(StatusCode::kUnavailable,
                          "source " + source.endpoint + ": no hello in the " +
                              std::to_string(static_cast<int64_t>(Millis(end - start))) +
                              " ms the fetch took (not used)");
      source.fd.Reset();
    }
    LOG_INFO << "arena fetch: setup " << Millis(reading_ - start)
             << " ms (connecting and the first hellos), reads " << Millis(end - reading_) << " ms";

    FetchResult result;
    result.seconds = std::chrono::duration<double>(end - start).count();
    result.setup_seconds = std::chrono::duration<double>(reading_ - start).count();
    result.transfer_seconds = std::chrono::duration<double>(end - reading_).count();
    for (Source& source : sources_) {
      result.sources.push_back({source.endpoint, source.used, source.bytes, source.why});
      result.bytes += source.bytes;
    }
    result.stripes = std::move(records_);
    result.gb_per_s =
        result.seconds > 0 ? static_cast<double>(result.bytes) / result.seconds / 1e9 : 0;
    result.transfer_gb_per_s = result.transfer_seconds > 0 ? static_cast<double>(result.bytes) /
                                                                 result.transfer_seconds / 1e9
                                                           : 0;
    return result;
  }

 private:
  void PlanStripes() {
    const uint64_t stripe = std::min(options_.stripe_bytes, kMaxReadBytes);
    for (size_t r = 0; r < options_.destination.size(); ++r) {
      const uint64_t bytes = options_.destination[r].bytes;
      for (uint64_t offset = 0; offset < bytes; offset += stripe) {
        stripes_.push_back({r, offset, std::min(stripe, bytes - offset)});
        total_ += stripes_.back().bytes;
      }
    }
    for (size_t i = 0; i < stripes_.size(); ++i) queue_.push_back(i);
    records_.resize(stripes_.size());
  }

  void Connect(size_t i) {
    Source& source = sources_[i];
    source.endpoint = options_.sources[i];
    source.connect_started = Clock::now();
    auto address = os::ResolveTcp(source.endpoint);
    if (!address.ok()) {
      Drop(source, address.status());
      return;
    }
    auto fd = os::ConnectTcp(*address);
    if (!fd.ok()) {
      Drop(source, fd.status().Context("source " + source.endpoint + ": connecting"));
      return;
    }
    source.fd = std::move(fd).value();
  }

  void Drop(Source& source, Status why) {
    if (source.phase == Phase::kDropped) return;
    LOG_WARN << "fleet: dropping source " << source.endpoint << ": " << why.ToString();
    source.phase = Phase::kDropped;
    source.why = std::move(why);
    // Its unfinished stripes go back to the queue, in front (they are the oldest).
    for (auto it = source.in_flight.rbegin(); it != source.in_flight.rend(); ++it) {
      queue_.push_front(*it);
    }
    source.in_flight.clear();
    source.out.clear();
    source.fd.Reset();
  }

  // The connect completed (writable): how.
  void Connected(Source& source) {
    int error = 0;
    socklen_t length = sizeof(error);
    if (::getsockopt(source.fd.get(), SOL_SOCKET, SO_ERROR, &error, &length) != 0) error = errno;
    if (error != 0) {
      Drop(source, Status(StatusCode::kUnavailable,
                          "source " + source.endpoint + ": connecting: " + std::strerror(error)));
      return;
    }
    source.phase = Phase::kHello;
  }

  // Reads the hello as far as it has come; checks it once whole.
  void ReceiveHello(Source& source) {
    const std::string who = "source " + source.endpoint;
    for (;;) {
      std::vector<uint8_t>& into = source.header_done ? source.body : source.header;
      const ssize_t n =
          RecvSome(source.fd.get(), into.data() + source.have, into.size() - source.have);
      if (n < 0 && Transient(errno)) return;
      if (n <= 0) {
        const int error = n < 0 ? errno : 0;
        if (!source.header_done && source.have == 0 && (n == 0 || error == ECONNRESET)) {
          // A source closes a connection from an address off its allow-list before any byte.
          Drop(source, PermissionDenied(who + " rejected the connection (closed it before its "
                                              "hello: is this node on its peer allow-list?)"));
        } else {
          Drop(source, Status(StatusCode::kUnavailable,
                              who + ": the connection " +
                                  (n == 0 ? std::string("closed") : std::strerror(error)) +
                                  " inside its hello"));
        }
        return;
      }
      source.have += static_cast<size_t>(n);
      if (source.have < into.size()) continue;
      source.have = 0;
      if (!source.header_done) {
        auto body = DecodeHelloHeader(source.header);
        if (!body.ok()) {
          Drop(source, body.status().Context(who));
          return;
        }
        source.header_done = true;
        source.body.resize(*body);
        continue;
      }
      Status accepted = AcceptHello(source);
      if (!accepted.ok()) {
        Drop(source, std::move(accepted));
        return;
      }
      source.phase = Phase::kReady;
      source.used = true;
      if (!first_ready_) first_ready_ = Clock::now();
      return;
    }
  }

  Status AcceptHello(Source& source) {
    const std::string who = "source " + source.endpoint;
    auto hello = DecodeHelloBody(source.body);
    source.body = {};
    if (!hello.ok()) return hello.status().Context(who);
    if (hello->protocol != HelloProtocol::kTcp) {
      return Status(StatusCode::kMismatch,
                    who +
                        " serves its regions over UCX (CUDA memory: a gpu-tier source), this "
                        "fill is into host memory");
    }
    if (hello->regions.size() != options_.destination.size()) {
      return Status(StatusCode::kMismatch, who + " serves " +
                                               std::to_string(hello->regions.size()) +
                                               " regions, the destination has " +
                                               std::to_string(options_.destination.size()));
    }
    for (size_t r = 0; r < hello->regions.size(); ++r) {
      if (hello->regions[r].bytes != options_.destination[r].bytes) {
        return Status(StatusCode::kMismatch, who + ": region " + std::to_string(r) + " is " +
                                                 std::to_string(hello->regions[r].bytes) +
                                                 " bytes, the destination's " +
                                                 std::to_string(options_.destination[r].bytes));
      }
    }
    if (options_.accept) {
      Status accepted = options_.accept(source.endpoint, hello->manifest);
      if (!accepted.ok()) return accepted.Context(who + " not accepted");
    }
    return Status::Ok();
  }

  // Requests stripes on `source` until its window is full or the queue is empty, and sends
  // what it can of the requests.
  void Request(Source& source) {
    while (!queue_.empty() && source.in_flight.size() < options_.max_in_flight_per_source) {
      const size_t s = queue_.front();
      queue_.pop_front();
      if (source.in_flight.empty()) source.last_progress = Clock::now();
      source.in_flight.push_back(s);
      const Stripe& stripe = stripes_[s];
      const std::vector<uint8_t> frame =
          EncodeReadRequest({static_cast<uint32_t>(stripe.region), stripe.offset, stripe.bytes});
      source.out.insert(source.out.end(), frame.begin(), frame.end());
    }
    while (source.out_sent < source.out.size()) {
      const ssize_t n = SendSome(source.fd.get(), source.out.data() + source.out_sent,
                                 source.out.size() - source.out_sent);
      if (n < 0 && Transient(errno)) break;
      if (n < 0) {
        Drop(source, Status(StatusCode::kUnavailable,
                            "source " + source.endpoint +
                                ": sending a read request: " + std::strerror(errno)));
        return;
      }
      source.out_sent += static_cast<size_t>(n);
    }
    if (source.out_sent == source.out.size()) {
      source.out.clear();
      source.out_sent = 0;
    }
  }

  // Reads answers into the destination, in request order.
  void ReceiveData(Source& source, size_t index) {
    while (source.phase == Phase::kReady && !source.in_flight.empty()) {
      const size_t s = source.in_flight.front();
      const Stripe& stripe = stripes_[s];
      auto* into = static_cast<uint8_t*>(options_.destination[stripe.region].data) + stripe.offset +
                   source.received_of_front;
      const ssize_t n = RecvSome(source.fd.get(), into, stripe.bytes - source.received_of_front);
      if (n < 0 && Transient(errno)) return;
      if (n <= 0) {
        Drop(source, Status(StatusCode::kUnavailable,
                            "source " + source.endpoint + ": the connection " +
                                (n == 0 ? std::string("closed") : std::strerror(errno)) +
                                " during a read"));
        return;
      }
      source.last_progress = Clock::now();
      source.received_of_front += static_cast<uint64_t>(n);
      if (source.received_of_front < stripe.bytes) continue;
      source.received_of_front = 0;
      source.in_flight.pop_front();
      source.bytes += stripe.bytes;
      records_[s] = {stripe.region, stripe.offset, stripe.bytes, index};
      done_ += stripe.bytes;
      ++completed_;
      if (options_.progress) options_.progress(done_, total_);
    }
  }

  bool Reading(Clock::time_point now) {
    if (reading_started_) return true;
    if (!first_ready_) return false;
    const bool waiting = std::any_of(sources_.begin(), sources_.end(), [](const Source& s) {
      return s.phase == Phase::kConnecting || s.phase == Phase::kHello;
    });
    if (waiting && now - *first_ready_ < kGatherWindow) return false;
    reading_started_ = true;
    reading_ = now;
    return true;
  }

  Status Loop() {
    std::vector<pollfd> fds;
    std::vector<size_t> which;
    size_t turn = 0;
    while (completed_ < stripes_.size()) {
      auto now = Clock::now();
      if (Reading(now)) {
        // Round-robin: each pass starts requesting at the next source.
        for (size_t k = 0; k < sources_.size(); ++k) {
          Source& source = sources_[(turn + k) % sources_.size()];
          if (source.phase == Phase::kReady) Request(source);
        }
        ++turn;
      }
      fds.clear();
      which.clear();
      for (size_t i = 0; i < sources_.size(); ++i) {
        const Source& source = sources_[i];
        short events = 0;
        if (source.phase == Phase::kConnecting) events = POLLOUT;
        if (source.phase == Phase::kHello) events = POLLIN;
        if (source.phase == Phase::kReady) {
          events = static_cast<short>((source.in_flight.empty() ? 0 : POLLIN) |
                                      (source.out.empty() ? 0 : POLLOUT));
        }
        if (events == 0) continue;
        fds.push_back({source.fd.get(), events, 0});
        which.push_back(i);
      }
      // With nothing to wait on (a ready source while the gather window runs), it sleeps.
      const int polled = os::SysCalls::Default().Poll(fds.data(), fds.size(), kPollMs);
      if (polled < 0 && errno != EINTR) {
        return Failure(StatusCode::kIo, std::string("poll: ") + std::strerror(errno));
      }
      if (Cancelled()) return Failure(StatusCode::kUnavailable, "cancelled");
      for (size_t k = 0; k < fds.size(); ++k) {
        Source& source = sources_[which[k]];
        const short revents = fds[k].revents;
        if (revents == 0) continue;
        if (source.phase == Phase::kConnecting) Connected(source);
        if (source.phase == Phase::kHello && (revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
          ReceiveHello(source);
        }
        if (source.phase == Phase::kReady) ReceiveData(source, which[k]);
      }
      now = Clock::now();
      for (Source& source : sources_) {
        if ((source.phase == Phase::kConnecting || source.phase == Phase::kHello) &&
            now - source.connect_started > options_.connect_timeout) {
          Drop(source, Status(StatusCode::kTimeout,
                              "source " + source.endpoint + ": no hello within " +
                                  std::to_string(options_.connect_timeout.count()) + " ms"));
        }
        // Answers come in order on one connection, so silence while any is owed is a stall.
        if (source.phase == Phase::kReady && !source.in_flight.empty() &&
            now - source.last_progress > options_.stripe_timeout) {
          Drop(source, Status(StatusCode::kTimeout,
                              "source " + source.endpoint + ": a read made no progress in " +
                                  std::to_string(options_.stripe_timeout.count()) + " ms"));
        }
      }
      const bool any = std::any_of(sources_.begin(), sources_.end(), [](const Source& s) {
        return s.phase != Phase::kDropped && s.phase != Phase::kUnused;
      });
      if (!any) return Failure(StatusCode::kUnavailable, "every source failed");
      if (now >= deadline_) {
        return Failure(StatusCode::kTimeout, "the fetch passed its deadline of " +
                                                 std::to_string(options_.deadline.count()) + " ms");
      }
    }
    if (!reading_started_) reading_ = Clock::now();  // unreachable: there is always a stripe
    return Status::Ok();
  }

  bool Cancelled() const { return options_.cancel != nullptr && options_.cancel->load(); }

  Status Failure(StatusCode code, const std::string& what) const {
    std::string message = "arena fetch: " + what + " (" + std::to_string(done_) + " of " +
                          std::to_string(total_) + " bytes read)";
    for (const Source& source : sources_) {
      if (source.endpoint.empty()) continue;  // not connected yet
      message += "; " + source.endpoint + ": ";
      message += source.phase == Phase::kDropped ? source.why.ToString() : "still serving";
    }
    return Status(code, message);
  }

  const FetchOptions& options_;
  Clock::time_point deadline_;
  std::optional<Clock::time_point> first_ready_;
  bool reading_started_ = false;
  Clock::time_point reading_;
  std::vector<Stripe> stripes_;
  std::deque<size_t> queue_;
  std::vector<StripeRecord> records_;
  uint64_t total_ = 0;
  uint64_t done_ = 0;
  size_t completed_ = 0;
  std::vector<Source> sources_;
};

}  // namespace tcp_fetch_detail

Result<FetchResult> FetchOverTcp(const FetchOptions& options) {
  tcp_fetch_detail::TcpFetch fetch(options);
  return fetch.Run();
}

}  // namespace weightcache::fleet
