// "did you mean": the closest known subcommand or flag to a misspelt command-line token.
#pragma once
#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace vqad::cli {

// Levenshtein distance.
size_t edit_distance(const std::string& a, const std::string& b);
// The candidate closest to `word` if it is close enough to be a likely typo, else "".
std::string closest(const std::string& word, const std::vector<std::string>& candidates);
// Walks argv through the subcommand tree of `app` and returns "unknown subcommand 'x'
// of 'vqad'; did you mean 'y'?" / "unknown flag '--x' of 'vqad train'; did you mean
// '--y'?" for the first token that matches nothing but is close to a known name; "" when
// there is no such token. Tokens with a '.' after "--" are config overrides (--a.b value)
// and are left to the config loader, which names the key.
std::string suggestion_for(CLI::App& app, int argc, char** argv);

}  // namespace vqad::cli
