#include "fleet/etcd_client.h"

#include <curl/curl.h>
#include <nettle/base64.h>

#include <algorithm>
#include <cctype>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>

#include "common/strict_json.h"

namespace weightcache::fleet {
namespace {

using nlohmann::json;

// libcurl's process-wide setup, once, before the first handle (it is not thread-safe itself).
void GlobalInitOnce() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

struct CurlDeleter {
  void operator()(CURL* curl) const { curl_easy_cleanup(curl); }
};
struct SlistDeleter {
  void operator()(curl_slist* list) const { curl_slist_free_all(list); }
};

// The response body, cut off at a cap: a hostile or broken endpoint cannot make us buffer
// more than max_response_bytes.
struct Body {
  std::string data;
  size_t cap = 0;
  bool overflow = false;
};

size_t WriteBody(char* ptr, size_t size, size_t count, void* user) {
  auto* body = static_cast<Body*>(user);
  const size_t n = size * count;
  if (body->data.size() + n > body->cap) {
    body->overflow = true;
    return 0;  // libcurl stops the transfer with CURLE_WRITE_ERROR
  }
  body->data.append(ptr, n);
  return n;
}

// host:port with a non-empty host of URL-safe characters (or a bracketed IPv6 literal) and a
// port 1-65535.
bool IsHostPort(std::string_view hp) {
  const size_t colon = hp.rfind(':');
  if (colon == std::string_view::npos || colon == 0) return false;
  const std::string_view host = hp.substr(0, colon);
  const std::string_view port = hp.substr(colon + 1);
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return false;
  }
  const int p = std::stoi(std::string(port));
  if (p < 1 || p > 65535) return false;
  if (host.front() == '[') {
    return host.back() == ']' && host.size() > 2 &&
           std::all_of(host.begin() + 1, host.end() - 1, [](char c) {
             return std::isxdigit(static_cast<unsigned char>(c)) || c == ':' || c == '.';
           });
  }
  return std::all_of(host.begin(), host.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '-' || c == '_';
  });
}

// An int64 the gateway spells as a JSON string (proto3 JSON) or, leniently, as a number.
// std::nullopt when absent (proto3 omits zero values); an error for any other type or text.
Result<std::optional<int64_t>> Int64Field(const json& object, const char* name) {
  auto it = object.find(name);
  if (it == object.end()) return std::optional<int64_t>();
  if (it->is_number_integer()) return std::optional<int64_t>(it->get<int64_t>());
  if (!it->is_string()) return ProtocolError(std::string("field ") + name + " is not an integer");
  const std::string& text = it->get_ref<const std::string&>();
  if (text.empty() || text.size() > 20) {
    return ProtocolError(std::string("field ") + name + " is not an integer");
  }
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (...) {
    used = 0;
  }
  if (used != text.size())
    return ProtocolError(std::string("field ") + name + " is not an integer");
  return std::optional<int64_t>(value);
}

Result<std::string> Base64Field(const json& object, const char* name) {
  auto it = object.find(name);
  if (it == object.end()) return std::string();  // proto3 omits empty bytes
  if (!it->is_string()) return ProtocolError(std::string("field ") + name + " is not a string");
  auto decoded = Base64Decode(it->get_ref<const std::string&>());
  if (!decoded.ok()) return Status(decoded.status()).Context(std::string("field ") + name);
  return decoded;
}

// The response's JSON object. The keepalive stream answers one object per line ("result"
// wrapping the response); the first line is the answer to our one request.
Result<json> ParseResponse(std::string_view body, bool stream) {
  if (stream) body = body.substr(0, body.find('\n'));
  json parsed;
  const std::string error = ParseStrictJson(body, parsed);
  if (!error.empty()) return ProtocolError("response: " + error);
  if (!parsed.is_object()) return ProtocolError("response is not a JSON object");
  if (!stream) return parsed;
  if (auto err = parsed.find("error"); err != parsed.end()) {
    std::string message = "stream error";
    if (err->is_object() && err->contains("message") && (*err)["message"].is_string()) {
      message = (*err)["message"].get<std::string>();
    }
    return Status(StatusCode::kUnavailable, "etcd: " + message.substr(0, 512));
  }
  auto result = parsed.find("result");
  if (result == parsed.end() || !result->is_object()) {
    return ProtocolError("stream response has no \"result\" object");
  }
  return *result;
}

// etcd's error for a non-200 answer: {"error": "...", "code": N, "message": "..."}. gRPC code
// 5 (NOT_FOUND: a lease that is gone) is kNotFound; anything else kUnavailable, quoted.
Status EtcdError(long http_status, std::string_view body) {
  json parsed;
  std::string message;
  int64_t code = -1;
  if (ParseStrictJson(body, parsed).empty() && parsed.is_object()) {
    if (parsed.contains("message") && parsed["message"].is_string()) {
      message = parsed["message"].get<std::string>();
    } else if (parsed.contains("error") && parsed["error"].is_string()) {
      message = parsed["error"].get<std::string>();
    }
    if (parsed.contains("code") && parsed["code"].is_number_integer()) {
      code = parsed["code"].get<int64_t>();
    }
  }
  if (message.empty()) message = "HTTP " + std::to_string(http_status) + " without etcd's error";
  message = message.substr(0, 512);
  if (code == 5) return NotFound("etcd: " + message);
  return Status(StatusCode::kUnavailable,
                "etcd: " + message + " (HTTP " + std::to_string(http_status) + ")");
}

json LeaseBody(int64_t lease) { return json{{"ID", std::to_string(lease)}}; }

}  // namespace

std::string Base64Encode(std::string_view data) {
  std::string out(BASE64_ENCODE_RAW_LENGTH(data.size()), '\0');
  if (data.empty()) return out;
  base64_encode_raw(out.data(), data.size(), reinterpret_cast<const uint8_t*>(data.data()));
  return out;
}

Result<std::string> Base64Decode(std::string_view text) {
  if (text.size() % 4 != 0) return ProtocolError("base64 length is not a multiple of 4");
  size_t padding = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    const bool alpha = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                       c == '+' || c == '/';
    if (c == '=' && i + 2 >= text.size()) {
      ++padding;
      continue;
    }
    if (!alpha || padding > 0) return ProtocolError("invalid base64");
  }
  std::string out(BASE64_DECODE_LENGTH(text.size()), '\0');
  if (text.empty()) return out;
  base64_decode_ctx ctx;
  base64_decode_init(&ctx);
  size_t n = out.size();
  if (base64_decode_update(&ctx, &n, reinterpret_cast<uint8_t*>(out.data()), text.size(),
                           text.data()) != 1 ||
      base64_decode_final(&ctx) != 1) {
    return ProtocolError("invalid base64");
  }
  out.resize(n);
  return out;
}

std::string PrefixRangeEnd(std::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    auto& last = reinterpret_cast<unsigned char&>(end.back());
    if (last < 0xff) {
      ++last;
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key (etcd: range_end "\0" = to the end)
}

Result<EtcdOptions> ParseRegistryUrl(std::string_view url) {
  std::string scheme;
  std::string_view rest;
  if (url.rfind("etcd://", 0) == 0) {
    scheme = "http://";
    rest = url.substr(7);
  } else if (url.rfind("etcds://", 0) == 0) {
    scheme = "https://";
    rest = url.substr(8);
  } else {
    return InvalidArgument("registry " + std::string(url) +
                           ": expected etcd://HOST:PORT[,HOST:PORT...] or etcds://...");
  }
  EtcdOptions options;
  while (true) {
    const size_t comma = rest.find(',');
    const std::string_view hp = rest.substr(0, comma);
    if (!IsHostPort(hp)) {
      return InvalidArgument("registry " + std::string(url) + ": \"" + std::string(hp) +
                             "\" is not HOST:PORT");
    }
    options.endpoints.push_back(scheme + std::string(hp));
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  return options;
}

Result<EtcdClient> EtcdClient::Create(EtcdOptions options) {
  if (options.endpoints.empty()) return InvalidArgument("etcd: no endpoint");
  bool https = false;
  for (const std::string& e : options.endpoints) {
    std::string_view hp;
    if (e.rfind("http://", 0) == 0) {
      hp = std::string_view(e).substr(7);
    } else if (e.rfind("https://", 0) == 0) {
      hp = std::string_view(e).substr(8);
      https = true;
    } else {
      return InvalidArgument("etcd endpoint " + e + ": expected http://HOST:PORT or https://...");
    }
    if (!IsHostPort(hp)) return InvalidArgument("etcd endpoint " + e + ": expected HOST:PORT");
  }
  if (https && options.tls.ca_file.empty()) {
    return InvalidArgument("etcd over TLS (etcds://) needs the CA file that signs its certificate");
  }
  if (options.tls.cert_file.empty() != options.tls.key_file.empty()) {
    return InvalidArgument("etcd TLS: a client certificate and its key go together");
  }
  if (options.timeout <= std::chrono::milliseconds::zero()) {
    return InvalidArgument("etcd: the timeout must be positive");
  }
  GlobalInitOnce();
  return EtcdClient(std::move(options));
}

Result<std::string> EtcdClient::Post(std::string_view path, const std::string& body) const {
  Status last;
  for (const std::string& endpoint : options_.endpoints) {
    const std::string url = endpoint + std::string(path);
    std::unique_ptr<CURL, CurlDeleter> curl(curl_easy_init());
    if (!curl) return InternalError("curl_easy_init failed");
    std::unique_ptr<curl_slist, SlistDeleter> headers(
        curl_slist_append(nullptr, "Content-Type: application/json"));
    Body response;
    response.cap = options_.max_response_bytes;
    char error[CURL_ERROR_SIZE] = {};
    CURL* c = curl.get();
    curl_easy_setopt(c, CURLOPT_URL, url.c_str());
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, error);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);  // threads: no SIGALRM for timeouts
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 0L);
    curl_easy_setopt(c, CURLOPT_PROXY, "");  // never through an http_proxy of the environment
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, static_cast<long>(options_.timeout.count()));
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(options_.timeout.count()));
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers.get());
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body.c_str());
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, static_cast<long>(body.size()));
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, WriteBody);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &response);
    if (!options_.tls.ca_file.empty())
      curl_easy_setopt(c, CURLOPT_CAINFO, options_.tls.ca_file.c_str());
    if (!options_.tls.cert_file.empty()) {
      curl_easy_setopt(c, CURLOPT_SSLCERT, options_.tls.cert_file.c_str());
      curl_easy_setopt(c, CURLOPT_SSLKEY, options_.tls.key_file.c_str());
    }
    const CURLcode rc = curl_easy_perform(c);
    const std::string where = "etcd " + endpoint + " " + std::string(path);
    if (response.overflow) {
      return ProtocolError(where + ": response larger than " +
                           std::to_string(options_.max_response_bytes) + " bytes");
    }
    if (rc == CURLE_COULDNT_CONNECT || rc == CURLE_COULDNT_RESOLVE_HOST ||
        rc == CURLE_OPERATION_TIMEDOUT || rc == CURLE_SEND_ERROR || rc == CURLE_RECV_ERROR ||
        rc == CURLE_GOT_NOTHING || rc == CURLE_SSL_CONNECT_ERROR) {
      // The endpoint is unreachable (or hung): the next one may serve.
      const std::string text = error[0] != '\0' ? error : curl_easy_strerror(rc);
      last =
          Status(rc == CURLE_OPERATION_TIMEDOUT ? StatusCode::kTimeout : StatusCode::kUnavailable,
                 where + ": " + text +
                     (rc == CURLE_OPERATION_TIMEDOUT
                          ? " (timeout " + std::to_string(options_.timeout.count()) + " ms)"
                          : ""));
      continue;
    }
    if (rc != CURLE_OK) {
      const std::string text = error[0] != '\0' ? error : curl_easy_strerror(rc);
      return Status(StatusCode::kUnavailable, where + ": " + text);
    }
    long http_status = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &http_status);
    if (http_status != 200) return EtcdError(http_status, response.data).Context(where);
    return std::move(response.data);
  }
  if (options_.endpoints.size() > 1) {
    last.Context("no etcd endpoint answered (tried " + std::to_string(options_.endpoints.size()) +
                 "; the last)");
  }
  return last;
}

Status EtcdClient::Put(std::string_view key, std::string_view value, int64_t lease) const {
  json body{{"key", Base64Encode(key)}, {"value", Base64Encode(value)}};
  if (lease != 0) body["lease"] = std::to_string(lease);
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::string text, Post("/v3/kv/put", body.dump()));
  auto parsed = ParseResponse(text, false);
  if (!parsed.ok()) return Status(parsed.status()).Context("etcd put");
  return Status::Ok();
}

Result<std::vector<KeyValue>> EtcdClient::RangePrefix(std::string_view prefix) const {
  const json body{{"key", Base64Encode(prefix)},
                  {"range_end", Base64Encode(PrefixRangeEnd(prefix))}};
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::string text, Post("/v3/kv/range", body.dump()));
  auto parsed = ParseResponse(text, false);
  if (!parsed.ok()) return Status(parsed.status()).Context("etcd range");
  std::vector<KeyValue> out;
  auto kvs = parsed->find("kvs");
  if (kvs == parsed->end()) return out;  // proto3 omits an empty list
  if (!kvs->is_array()) return ProtocolError("etcd range: \"kvs\" is not a list");
  for (const json& item : *kvs) {
    if (!item.is_object()) return ProtocolError("etcd range: a kvs entry is not an object");
    KeyValue kv;
    auto key = Base64Field(item, "key");
    if (!key.ok()) return Status(key.status()).Context("etcd range");
    auto value = Base64Field(item, "value");
    if (!value.ok()) return Status(value.status()).Context("etcd range");
    auto lease = Int64Field(item, "lease");
    if (!lease.ok()) return Status(lease.status()).Context("etcd range");
    auto mod = Int64Field(item, "mod_revision");
    if (!mod.ok()) return Status(mod.status()).Context("etcd range");
    kv.key = std::move(key).value();
    kv.value = std::move(value).value();
    kv.lease = lease->value_or(0);
    kv.mod_revision = mod->value_or(0);
    if (kv.key.rfind(prefix, 0) != 0) {
      return ProtocolError("etcd range: a key outside the prefix asked for");
    }
    out.push_back(std::move(kv));
  }
  return out;
}

Result<KeyValue> EtcdClient::Get(std::string_view key) const {
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::vector<KeyValue> kvs, RangePrefix(key));
  for (KeyValue& kv : kvs) {
    if (kv.key == key) return std::move(kv);
  }
  return NotFound("etcd: no key " + std::string(key));
}

Result<int64_t> EtcdClient::DeletePrefix(std::string_view prefix) const {
  const json body{{"key", Base64Encode(prefix)},
                  {"range_end", Base64Encode(PrefixRangeEnd(prefix))}};
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::string text, Post("/v3/kv/deleterange", body.dump()));
  auto parsed = ParseResponse(text, false);
  if (!parsed.ok()) return Status(parsed.status()).Context("etcd deleterange");
  auto deleted = Int64Field(*parsed, "deleted");
  if (!deleted.ok()) return Status(deleted.status()).Context("etcd deleterange");
  return deleted->value_or(0);
}

Result<int64_t> EtcdClient::LeaseGrant(int64_t ttl_seconds) const {
  if (ttl_seconds < 1) return InvalidArgument("etcd lease TTL must be >= 1 s");
  const json body{{"TTL", std::to_string(ttl_seconds)}};
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::string text, Post("/v3/lease/grant", body.dump()));
  auto parsed = ParseResponse(text, false);
  if (!parsed.ok()) return Status(parsed.status()).Context("etcd lease grant");
  if (auto e = parsed->find("error"); e != parsed->end() && e->is_string() && !e->empty()) {
    return Status(StatusCode::kUnavailable,
                  "etcd lease grant: " + e->get<std::string>().substr(0, 512));
  }
  auto id = Int64Field(*parsed, "ID");
  if (!id.ok()) return Status(id.status()).Context("etcd lease grant");
  if (!id->has_value() || **id == 0)
    return ProtocolError("etcd lease grant: no lease ID in the response");
  return **id;
}

Result<int64_t> EtcdClient::LeaseKeepAlive(int64_t lease) const {
  WEIGHTCACHE_ASSIGN_OR_RETURN(std::string text,
                               Post("/v3/lease/keepalive", LeaseBody(lease).dump()));
  auto parsed = ParseResponse(text, true);
  if (!parsed.ok()) return Status(parsed.status()).Context("etcd lease keepalive");
  auto ttl = Int64Field(*parsed, "TTL");
  if (!ttl.ok()) return Status(ttl.status()).Context("etcd lease keepalive");
  // etcd answers a lease it no longer has with TTL 0 (omitted in proto3 JSON).
  if (!ttl->has_value() || **ttl <= 0) {
    return NotFound("etcd lease " + std::to_string(lease) + " is gone (expired or revoked)");
  }
  return **ttl;
}

Status EtcdClient::LeaseRevoke(int64_t lease) const {
  auto text = Post("/v3/lease/revoke", LeaseBody(lease).dump());
  if (!text.ok()) {
    if (text.status().code() == StatusCode::kNotFound) return Status::Ok();  // already gone
    return text.status();
  }
  auto parsed = ParseResponse(*text, false);
  if (!parsed.ok()) return Status(parsed.status()).Context("etcd lease revoke");
  return Status::Ok();
}

}  // namespace weightcache::fleet
