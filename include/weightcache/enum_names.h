// weightcache/enum_names.h — one table per enum that names its values: the name and the parse of
// each enum are both read off that table, so the two cannot drift apart (docs/contributing.md).
//
//   inline constexpr std::array<EnumName<Tier>, 2> kTierNames{{{Tier::kGpu, "gpu"},
//                                                             {Tier::kHost, "host"}}};
//   static_assert(IsDenseEnumTable(kTierNames));
//   NameIn(kTierNames, tier, "unknown");  ParseIn(kTierNames, "gpu");  NamesIn(kTierNames);
//
// A table lists the enumerators in value order from 0 with no gap (IsDenseEnumTable, checked by
// a static_assert beside each table), so a name is looked up by index.
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace weightcache {

template <class E>
struct EnumName {
  E value;
  std::string_view name;
};

// Every entry's value is its index: the enumerators 0, 1, 2 … in order, none left out in
// between, and no name given twice.
template <class E, size_t N>
constexpr bool IsDenseEnumTable(const std::array<EnumName<E>, N>& table) {
  for (size_t i = 0; i < N; ++i) {
    if (static_cast<size_t>(table[i].value) != i || table[i].name.empty()) return false;
    for (size_t j = 0; j < i; ++j) {
      if (table[j].name == table[i].name) return false;
    }
  }
  return true;
}

// The name of `value`; `unknown` for a value outside the table (one cast from bad bytes).
template <class E, size_t N>
constexpr std::string_view NameIn(const std::array<EnumName<E>, N>& table, E value,
                                  std::string_view unknown) {
  const auto index = static_cast<size_t>(value);
  return index < N ? table[index].name : unknown;
}

// The value named exactly `name`, else nullopt (the caller reports the error in its own terms).
template <class E, size_t N>
constexpr std::optional<E> ParseIn(const std::array<EnumName<E>, N>& table, std::string_view name) {
  for (const EnumName<E>& entry : table) {
    if (entry.name == name) return entry.value;
  }
  return std::nullopt;
}

// Every value of the table, in order (for code that iterates over the enum).
template <class E, size_t N>
constexpr std::array<E, N> ValuesIn(const std::array<EnumName<E>, N>& table) {
  std::array<E, N> out{};
  for (size_t i = 0; i < N; ++i) out[i] = table[i].value;
  return out;
}

// "a, b, c": every name, for an error message that says what is accepted.
template <class E, size_t N>
std::string NamesIn(const std::array<EnumName<E>, N>& table) {
  std::string out;
  for (const EnumName<E>& entry : table) {
    if (!out.empty()) out += ", ";
    out += entry.name;
  }
  return out;
}

}  // namespace weightcache
