#include "vqad/data/arrow_util.h"

#include "vqad/core/error.h"

namespace vqad::data::arrow_util {

void check_status(const arrow::Status& status, const std::string& what) {
  if (!status.ok()) fail(what, ": ", status.ToString());
}

std::pair<const arrow::Array*, int64_t> chunk_at(const arrow::ChunkedArray& column, int64_t row) {
  int64_t r = row;
  for (const auto& chunk : column.chunks()) {
    if (r < chunk->length()) return {chunk.get(), r};
    r -= chunk->length();
  }
  fail("row ", row, " is past the end of a column of ", column.length(), " rows");
}

std::optional<std::string_view> binary_at(const arrow::ChunkedArray& column, int64_t row,
                                          const std::string& what) {
  auto [arr, i] = chunk_at(column, row);
  if (arr->IsNull(i)) return std::nullopt;
  switch (arr->type_id()) {
    case arrow::Type::BINARY:
    case arrow::Type::STRING:
      return static_cast<const arrow::BinaryArray*>(arr)->GetView(i);
    case arrow::Type::LARGE_BINARY:
    case arrow::Type::LARGE_STRING:
      return static_cast<const arrow::LargeBinaryArray*>(arr)->GetView(i);
    case arrow::Type::BINARY_VIEW:
    case arrow::Type::STRING_VIEW:
      return static_cast<const arrow::BinaryViewArray*>(arr)->GetView(i);
    default:
      fail(what, ": expected a binary or string column, found type ", arr->type()->ToString());
  }
}

namespace {
std::vector<int64_t> ints_of(const arrow::Array& values, int64_t offset, int64_t length,
                             const std::string& what) {
  std::vector<int64_t> out;
  out.reserve(size_t(length));
  for (int64_t k = 0; k < length; ++k) {
    VQAD_CHECK(!values.IsNull(offset + k), what, ": null element in an integer list");
    switch (values.type_id()) {
      case arrow::Type::INT64:
        out.push_back(static_cast<const arrow::Int64Array&>(values).Value(offset + k));
        break;
      case arrow::Type::INT32:
        out.push_back(static_cast<const arrow::Int32Array&>(values).Value(offset + k));
        break;
      case arrow::Type::UINT64:
        out.push_back(int64_t(static_cast<const arrow::UInt64Array&>(values).Value(offset + k)));
        break;
      case arrow::Type::UINT32:
        out.push_back(static_cast<const arrow::UInt32Array&>(values).Value(offset + k));
        break;
      default:
        fail(what, ": expected a list of integers, found element type ",
             values.type()->ToString());
    }
  }
  return out;
}
}  // namespace

std::optional<std::vector<int64_t>> int_list_at(const arrow::ChunkedArray& column, int64_t row,
                                                const std::string& what) {
  auto [arr, i] = chunk_at(column, row);
  if (arr->IsNull(i)) return std::nullopt;
  switch (arr->type_id()) {
    case arrow::Type::LIST: {
      auto* l = static_cast<const arrow::ListArray*>(arr);
      return ints_of(*l->values(), l->value_offset(i), l->value_length(i), what);
    }
    case arrow::Type::LARGE_LIST: {
      auto* l = static_cast<const arrow::LargeListArray*>(arr);
      return ints_of(*l->values(), l->value_offset(i), l->value_length(i), what);
    }
    case arrow::Type::FIXED_SIZE_LIST: {
      auto* l = static_cast<const arrow::FixedSizeListArray*>(arr);
      return ints_of(*l->values(), l->value_offset(i), l->value_length(i), what);
    }
    default:
      fail(what, ": expected a list<int64> column, found type ", arr->type()->ToString());
  }
}

std::optional<int64_t> int_at(const arrow::ChunkedArray& column, int64_t row,
                              const std::string& what) {
  auto [arr, i] = chunk_at(column, row);
  if (arr->IsNull(i)) return std::nullopt;
  switch (arr->type_id()) {
    case arrow::Type::INT64: return static_cast<const arrow::Int64Array*>(arr)->Value(i);
    case arrow::Type::INT32: return static_cast<const arrow::Int32Array*>(arr)->Value(i);
    default: fail(what, ": expected an int64 column, found type ", arr->type()->ToString());
  }
}

std::optional<double> double_at(const arrow::ChunkedArray& column, int64_t row,
                                const std::string& what) {
  auto [arr, i] = chunk_at(column, row);
  if (arr->IsNull(i)) return std::nullopt;
  switch (arr->type_id()) {
    case arrow::Type::DOUBLE: return static_cast<const arrow::DoubleArray*>(arr)->Value(i);
    case arrow::Type::FLOAT: return static_cast<const arrow::FloatArray*>(arr)->Value(i);
    case arrow::Type::INT64: return double(static_cast<const arrow::Int64Array*>(arr)->Value(i));
    default: fail(what, ": expected a float64 column, found type ", arr->type()->ToString());
  }
}

}  // namespace vqad::data::arrow_util
