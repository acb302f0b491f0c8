// The module compiled for one (dtype, head_dim): every kernel of that
// variant. The host instantiates the templates through name expressions.
#include "general_fwd.cuh"
#include "general_bwd.cuh"
#include "tc_fwd.cuh"
#include "tc_fwd_wg.cuh"
#include "tc_bwd.cuh"
#include "tc_bwd_wide.cuh"
#include "tc_bwd_wg.cuh"
#include "split_fwd_wg.cuh"
#include "split_fwd_wide_wg.cuh"
#include "split_bwd_wg.cuh"
#include "tc32_fwd.cuh"
#include "tc32_bwd.cuh"
