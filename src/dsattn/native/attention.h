// The compiled attention forward (attention.cpp), for the bindings and for the steps that call it.
#pragma once

#include <ATen/ATen.h>

#include <vector>

std::vector<at::Tensor> sparse_attention_forward(const at::Tensor& q, const std::vector<at::Tensor>& sources,
                                                 const std::vector<at::Tensor>& rows,
                                                 const c10::optional<at::Tensor>& sinks, double scale,
                                                 const c10::optional<at::Tensor>& out_into,
                                                 const c10::optional<at::Tensor>& lse_into, bool sink_in_lse,
                                                 const c10::optional<at::Tensor>& max_into,
                                                 const std::vector<std::vector<int64_t>>& format_fields,
                                                 const c10::optional<at::Tensor>& stats_into);
