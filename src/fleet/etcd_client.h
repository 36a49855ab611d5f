// EtcdClient — the few etcd v3 calls the fleet registry needs (docs/fleet.md, "Registry"),
// spoken through etcd's own JSON gRPC gateway
// (https://etcd.io/docs/v3.4/dev-guide/api_grpc_gateway/): POST /v3/kv/put, /v3/kv/range,
// /v3/kv/deleterange, /v3/lease/grant, /v3/lease/keepalive and /v3/lease/revoke, keys and values
// base64, 64-bit integers as JSON strings. HTTP and TLS are libcurl's; nothing here parses HTTP.
//
// Contract:
//  * Every call is bounded: each endpoint gets `timeout` for the whole exchange (connect,
//    request, response). A connection failure or a timeout moves on to the next endpoint; an
//    answer from etcd (an HTTP error with etcd's error JSON, or a malformed body) is final.
//    Errors name the endpoint and the call, and quote etcd's own message.
//  * Responses are untrusted: bodies over `max_response_bytes` are cut off (kProtocol), JSON
//    is parsed without exceptions escaping, every field read is type-checked, base64 is decoded
//    strictly.
//  * Thread-safety: a const EtcdClient may be used from any number of threads at once (each
//    call has its own curl handle); it holds no connection between calls.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "weightcache/status.h"

namespace weightcache::fleet {

// etcds:// endpoints (https): the CA that signs etcd's server certificate, and a client
// certificate and key when etcd requires client authentication (--client-cert-auth).
struct EtcdTls {
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
};

struct EtcdOptions {
  // "http://host:port" or "https://host:port", tried in order.
  std::vector<std::string> endpoints;
  EtcdTls tls;
  std::chrono::milliseconds timeout{3000};
  size_t max_response_bytes = size_t{16} << 20;
};

// `etcd://HOST:PORT[,HOST:PORT...]` (http) or `etcds://...` (https) → the endpoints of
// EtcdOptions, other fields at their defaults. kInvalidArgument naming the URL otherwise.
Result<EtcdOptions> ParseRegistryUrl(std::string_view url);

struct KeyValue {
  std::string key;
  std::string value;
  int64_t lease = 0;  // 0: no lease
  int64_t mod_revision = 0;
};

class EtcdClient {
 public:
  // kInvalidArgument for no endpoint, an endpoint that is not http(s)://host:port, https
  // without a CA file, or a client certificate without its key.
  static Result<EtcdClient> Create(EtcdOptions options);

  // Puts key = value, attached to `lease` (0: none). kNotFound when the lease is gone.
  Status Put(std::string_view key, std::string_view value, int64_t lease = 0) const;
  // Every key that starts with `prefix`, in key order.
  Result<std::vector<KeyValue>> RangePrefix(std::string_view prefix) const;
  // The value of one key, or kNotFound.
  Result<KeyValue> Get(std::string_view key) const;
  // Deletes every key that starts with `prefix`; how many were deleted.
  Result<int64_t> DeletePrefix(std::string_view prefix) const;

  // A new lease of `ttl_seconds` (>= 1); its id.
  Result<int64_t> LeaseGrant(int64_t ttl_seconds) const;
  // Renews the lease; its TTL in seconds after the renewal. kNotFound when etcd no longer has
  // the lease (expired or revoked): its keys are gone.
  Result<int64_t> LeaseKeepAlive(int64_t lease) const;
  // Revokes the lease: its keys are deleted at once. A lease already gone is no error.
  Status LeaseRevoke(int64_t lease) const;

  const EtcdOptions& options() const { return options_; }

 private:
  explicit EtcdClient(EtcdOptions options) : options_(std::move(options)) {}

  // POSTs `body` to `path` on each endpoint in turn (moving on after a connection failure or
  // a timeout); the response body of the first endpoint that answered 200.
  Result<std::string> Post(std::string_view path, const std::string& body) const;

  EtcdOptions options_;
};

// Base64 (RFC 4648, with padding), the gateway's encoding of keys and values. Decode is
// strict: kProtocol for a length that is not a multiple of 4 or a character outside the
// alphabet.
std::string Base64Encode(std::string_view data);
Result<std::string> Base64Decode(std::string_view text);

// The first key after every key with this prefix (etcd's range_end for a prefix query).
std::string PrefixRangeEnd(std::string_view prefix);

}  // namespace weightcache::fleet
