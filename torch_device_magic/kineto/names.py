"""What the names in a kineto trace are: which ops are matmuls, convolutions, copies,
casts, factories, indexing and a batch's collation, which runtime calls synchronise or
launch, which rows are the profiler's own, and kineto's dtype names. Facts only:
`kineto.events` reads a trace with them and the profile's rules (`advice.profile_rules`)
say things with them."""

from __future__ import annotations

MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
                     "aten::linear", "aten::convolution", "aten::_convolution",
                     "aten::cudnn_convolution", "aten::conv1d", "aten::conv2d",
                     "aten::conv3d"})
# the ops whose fp32 inputs take tensor cores under torch.backends.cuda.matmul's TF32; the
# other MATMULS are convolutions, under torch.backends.cudnn's
CUBLAS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
                    "aten::linear"})
REDUCED = ("c10::Half", "c10::BFloat16", "c10::Float8")  # kineto's dtype names: tensor cores
# kernel names, the second signal only (they change with every cuBLAS release): marks of a
# tensor-core GEMM or convolution (Volta's to Hopper's: nvjet is cuBLASLt's on sm90), and of
# the FMA units' (an xmma kernel of f32f32 types with ffma, an sgemm)
TENSOR_CORE_MARKS = ("nvjet", "tf32", "hmma", "gmma", "wmma", "tensorop", "884", "1688",
                     "16816", "bf16", "f16")
NO_TENSOR_CORE_MARKS = ("ffma", "sgemm")
CASTS = frozenset({"aten::to", "aten::_to_copy", "aten::copy_"})  # a dtype cast's ops
LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
          "hipLaunchKernel")
# first-call loading: CUDA's lazy module loading (CUPTI's rows), the driver's module loads,
# torch.compile's compiling (its dynamo_timed ranges)
LOADING = frozenset({"Lazy Function Loading", "Runtime Triggered Module Loading"})
LOADING_CALLS = ("cuModuleLoad", "cuLibraryLoad")
COMPILING = " (dynamo_timed)"
SYNC_CALLS = frozenset({
    "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
    "hipDeviceSynchronize", "hipStreamSynchronize", "hipEventSynchronize", "hipMemcpy",
})
ITEM = frozenset({"aten::item", "aten::_local_scalar_dense"})
# the outermost op around a synchronising call names the read (print(tensor) reads
# by .item() and .cpu(); .tolist() by .cpu())
READS = {"aten::item": ".item()", "aten::_local_scalar_dense": ".item()",
         "aten::to": ".cpu()/.to()/.tolist()", "aten::_to_copy": ".cpu()/.to()/.tolist()",
         "aten::copy_": ".copy_()", "aten::nonzero": "nonzero()",
         "aten::index": "boolean-mask indexing", "aten::masked_select": "boolean-mask indexing"}
RUNTIME = frozenset({"cuda_runtime", "cuda_driver", "privateuse1_runtime",
                     "privateuse1_driver", "xpu_runtime", "xpu_driver"})
FILTERED = frozenset({
    "profiler::_record_function_enter", "profiler::_record_function_enter_new",
    "profiler::_record_function_exit", "aten::is_leaf", "aten::output_nr", "aten::_version",
})

# CUPTI's own rows (seen on an H200, torch 2.11): its buffer requests, CUDA's module
# loading it saw, and an unnamed one; kineto's activity type "overhead" marks the others
PROFILERS_OWN = frozenset({"Activity Buffer Request", "INVALID", "Lazy Function Loading",
                           "Runtime Triggered Module Loading"})

# where a copy's bytes are among its op's inputs: the source of copy_(self, src), the
# tensor that _to_copy and .item()'s read take
COPY_SOURCE = {"aten::copy_": 1, "aten::_to_copy": 0, "aten::_local_scalar_dense": 0}
# the ops whose inputs' dtypes from_kineto reads (a copy's size, a matmul's tensor cores):
# asking costs about 3 µs an event, so only theirs
# the ops whose work torch.utils.flop_counter has a formula for (its registry's aten ops, in
# torch 2.4 to 2.13), and torch's CPU kernels of attention, counted by the flash kernel's
FLOP_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm",
    "aten::convolution", "aten::_convolution", "aten::cudnn_convolution",
    "aten::convolution_overrideable", "aten::_slow_conv2d_forward", "aten::convolution_backward",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_efficient_attention_backward",
    "aten::_scaled_dot_product_flash_attention_backward",
    "aten::_scaled_dot_product_cudnn_attention_backward", "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward", "aten::_flash_attention_backward",
    "aten::_efficient_attention_backward",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
})
# what the overview calls the counted ops, where they are all of one kind
FLOP_KINDS = {"aten::mm": "matmul", "aten::addmm": "matmul", "aten::bmm": "matmul",
              "aten::baddbmm": "matmul", "aten::_scaled_mm": "matmul",
              "aten::convolution": "convolution", "aten::_convolution": "convolution",
              "aten::convolution_backward": "convolution"}
DTYPES_READ = MATMULS | FLOP_OPS | frozenset(COPY_SOURCE)
# kineto's names of the dtypes (caffe2's TypeMeta names), and their bytes an element
ITEMSIZE = {
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
    "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1, "short unsigned int": 2,
    "unsigned int": 4, "long unsigned int": 8, "c10::complex<float>": 8,
    "c10::complex<double>": 16, "c10::complex<c10::Half>": 4, "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1, "c10::Float8_e4m3fnuz": 1, "c10::Float8_e5m2fnuz": 1,
}
FACTORIES = frozenset({"aten::randn", "aten::rand", "aten::randint", "aten::zeros",
                       "aten::ones", "aten::empty", "aten::full", "aten::arange",
                       "aten::randperm", "aten::normal", "aten::linspace", "aten::eye"})
INDEXING = frozenset({"aten::index", "aten::index_put_", "aten::select", "aten::slice",
                      "aten::index_select", "aten::gather", "aten::masked_select"})
COLLATE = frozenset({"aten::stack", "aten::cat"})  # default_collate's: one a batch and field
# the single-process DataLoader's range around each batch (`record_function` in __next__)
LOADER_NEXT = ("DataLoaderIter.__next__", "_SingleProcess")
