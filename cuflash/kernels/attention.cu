// The module compiled for one (dtype, head_dim): every general kernel.
// The host instantiates the templates through name expressions.
#include "general_fwd.cuh"
#include "general_bwd.cuh"
