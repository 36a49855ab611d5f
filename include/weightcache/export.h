/* weightcache/export.h — which declarations libweightcache.so exports (docs/sdk.md).
 *
 * The library is compiled with -fvisibility=hidden and linked with a version script, so only
 * what is marked WEIGHTCACHE_EXPORT here and in the other public headers (the C ABI of
 * c_api.h, the classes and functions of client.h, publisher.h and status.h) is visible to a
 * program that links it; everything in src/ stays internal. Plain C, included by c_api.h.
 */
#ifndef WEIGHTCACHE_EXPORT_H_
#define WEIGHTCACHE_EXPORT_H_

#if defined(__cplusplus) && (defined(__GNUC__) || defined(__clang__))
/* The standard attribute syntax: it may follow [[nodiscard]] on a class. */
#define WEIGHTCACHE_EXPORT [[gnu::visibility("default")]]
#elif defined(__GNUC__) || defined(__clang__)
#define WEIGHTCACHE_EXPORT __attribute__((visibility("default")))
#else
#define WEIGHTCACHE_EXPORT
#endif

#endif /* WEIGHTCACHE_EXPORT_H_ */
