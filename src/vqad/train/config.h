// The run configuration lives in the config module (src/vqad/config/run_config.h);
// this header keeps the includes of the trainer and its users working.
#pragma once
#include "vqad/config/run_config.h"
