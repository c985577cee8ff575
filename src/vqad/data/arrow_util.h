// Small helpers over Arrow arrays shared by the parquet reader, writer and CLI.
#pragma once
#include <arrow/api.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace vqad::data::arrow_util {

// The chunk holding `row` of a chunked column and the row's offset inside it.
std::pair<const arrow::Array*, int64_t> chunk_at(const arrow::ChunkedArray& column, int64_t row);

// Value accessors; nullopt for a null value. They throw vqad::Error naming
// `what` (file/row/column context) when the column type is not the expected one.
std::optional<std::string_view> binary_at(const arrow::ChunkedArray& column, int64_t row,
                                          const std::string& what);
std::optional<std::vector<int64_t>> int_list_at(const arrow::ChunkedArray& column, int64_t row,
                                                const std::string& what);
std::optional<int64_t> int_at(const arrow::ChunkedArray& column, int64_t row,
                              const std::string& what);
std::optional<double> double_at(const arrow::ChunkedArray& column, int64_t row,
                                const std::string& what);

// Throws vqad::Error("<what>: <status message>") for a failed Arrow status.
void check_status(const arrow::Status& status, const std::string& what);
template <typename T>
T unwrap(arrow::Result<T> result, const std::string& what) {
  check_status(result.status(), what);
  return std::move(result).ValueUnsafe();
}

}  // namespace vqad::data::arrow_util
