// This level's copy of the kernels as a table (compiled once per level, like the kernels).
#include "dispatch.h"

namespace pflcore::cpu {
PFLCORE_LEVEL_BEGIN

const KernelTable& level_table() {
  static const KernelTable table = [] {
    KernelTable t{};
    t.level = PFLCORE_CPU_LEVEL_NAME;
    t.local_steps = {local_steps<float>, local_steps<double>};
    t.gradients = {gradients<float>, gradients<double>};
    t.evaluate = {evaluate<float>, evaluate<double>};
    t.kmeans_assign = {kmeans_assign<float>, kmeans_assign<double>};
    t.kmeans_update = {kmeans_update<float>, kmeans_update<double>};
    t.kmeans_lloyd = {kmeans_lloyd<float>, kmeans_lloyd<double>};
    t.anderson_push = {anderson_push<float>, anderson_push<double>};
    t.anderson_mix = {anderson_mix<float>, anderson_mix<double>};
    t.gram = {gram<float>, gram<double>};
    t.average = {average<float>, average<double>};
    t.clip_and_sum = {clip_and_sum<float>, clip_and_sum<double>};
    t.cnn_shifted_gemm = {cnn_shifted_gemm<float>, cnn_shifted_gemm<double>};
    t.cnn_input_grad = {cnn_input_grad<float>, cnn_input_grad<double>};
    t.cnn_shifted_corr = {cnn_shifted_corr<float>, cnn_shifted_corr<double>};
    t.cnn_pool_relu = {cnn_pool_relu<float>, cnn_pool_relu<double>};
    t.cnn_conv_pool_relu = {cnn_conv_pool_relu<float>, cnn_conv_pool_relu<double>};
    t.cnn_pool_relu_backward = {cnn_pool_relu_backward<float>, cnn_pool_relu_backward<double>};
    t.cnn_pooled_backward = {cnn_pooled_backward<float>, cnn_pooled_backward<double>};
    t.cnn_dense_grad = {cnn_dense_grad<float>, cnn_dense_grad<double>};
    t.cnn_dense_logits = {cnn_dense_logits<float>, cnn_dense_logits<double>};
    t.sym_products = {sym_products<float>, sym_products<double>};
    t.perm_screen_stats = {perm_screen_stats<float>, perm_screen_stats<double>};
    t.dp_normals = dp_normals;
    t.anderson_solve = anderson_solve;
    t.water_fill = water_fill;
    t.water_fill_gram = {water_fill_gram<float>, water_fill_gram<double>};
    t.water_fill_screened = {water_fill_screened<float>, water_fill_screened<double>};
    t.sample_batches = sample_batches;
    t.mlp_local_steps_supported = mlp_local_steps_supported;
    t.mlp_local_steps = mlp_local_steps;
    return t;
  }();
  return table;
}

PFLCORE_LEVEL_END
}  // namespace pflcore::cpu
