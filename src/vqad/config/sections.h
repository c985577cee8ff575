// Internal to the config module: each section's schema (its key descriptors) and its
// reader, and the resolved dump of each section.
#pragma once
#include "vqad/config/run_config.h"

namespace vqad::train::sections {

using config::as_bool;
using config::as_int;
using config::as_string;
using config::check;
using config::Ctx;
using config::describe;
using config::falsy;
using config::format_double;
using config::is_int_text;
using config::join;
using config::key_fail;
using config::KeyDesc;
using config::KeyStatus;
using config::KeyType;
using config::Section;
using config::SectionSchema;
using config::trim;
using K = KeyType;

// Schemas (tables of key descriptors), one per mapping of the config.
const SectionSchema& top_level_schema();
const std::vector<const SectionSchema*>& training_schemas();  // training and its subsections
const SectionSchema& role_schema();                           // models.<role>
const std::vector<const SectionSchema*>& method_schemas();    // method (one per kind) and its subsections
const std::vector<const SectionSchema*>& callback_schemas();  // callbacks.<name> by kind
const std::vector<const SectionSchema*>& pipeline_schemas();

// Readers.
TrainingConfig parse_training(const Ctx& ctx, const Json* node, const Json& models);
RoleConfig parse_role(const Ctx& ctx, const std::string& name, const Json& node, const TrainingConfig& training,
                      const std::string& pipeline_quant);
MethodConfig parse_method(const Ctx& ctx, const Json* node);
CallbacksConfig parse_callbacks(const Ctx& ctx, const Json* node);
PipelineConfig parse_pipeline(const Ctx& ctx, const Json* node);

// Resolved dump (every value, defaults filled in, loadable again).
Json to_json(const RoleConfig& r);
Json to_json(const MethodConfig& m);
Json to_json(const TrainingConfig& t);
Json to_json(const CallbacksConfig& c, const Json& raw_callbacks);
Json to_json(const PipelineConfig& p);

// Descriptor helpers for the tables.
inline KeyDesc key(std::string name, KeyType type, Json def, std::string help, bool or_default = false) {
  KeyDesc d;
  d.key = std::move(name);
  d.type = type;
  d.default_value = std::move(def);
  d.help = std::move(help);
  d.or_default = or_default;
  return d;
}
inline KeyDesc choice_key(std::string name, std::vector<std::string> choices, Json def, std::string help,
                          bool or_default = false) {
  KeyDesc d = key(std::move(name), KeyType::kChoice, std::move(def), std::move(help), or_default);
  d.choices = std::move(choices);
  return d;
}
inline KeyDesc planned(KeyDesc d, std::string by) {
  d.status = KeyStatus::kPlanned;
  d.planned_by = std::move(by);
  return d;
}
inline KeyDesc not_supported_yet(KeyDesc d, Json inert = nullptr) {
  d.status = KeyStatus::kNotSupportedYet;
  d.inert = std::move(inert);
  return d;
}

}  // namespace vqad::train::sections

namespace vqad::train::sections {
// enable_gradient_checkpointing_type values ('' | full | ops | block_skip) and the
// refusal of the ones vqad does not implement yet (ops, block_skip).
const std::vector<std::string>& checkpointing_types();
void check_checkpointing_type(const Ctx& ctx, const std::string& path, const std::string& value);
}  // namespace vqad::train::sections
