"""The profiler's kernel buckets: GPU kernel names as the H200 profiles printed them, sorted into kinds."""
from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from trainer.model.profile import (bucket, host_chains, idle_gaps, kernel_rows, kernel_sites, label, launching_thread,
                                   merged, where)


def test_kernel_names_fall_into_their_kinds() -> None:
    kinds = {
        "chunk_kda_bwd_dqkg_kernel": "kda", "l2norm_fwd_kernel": "kda",
        "triton_tem_fused_flex_attention_0": "attention",
        # torch.nn.attention.varlen's kernels (FlashAttention-2 in ATen; cuDNN's for bidirectional segments)
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>": "attention",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>": "attention",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1": "attention",
        "grouped_mm_kernel": "expert gemm", "grouped_wgrad_kernel": "expert gemm",
        # torch._grouped_mm on sm_90 (name cut short); a plain CUTLASS GEMM stays dense
        "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversalINS5_"
        "17GroupProblemShapeIN4cute5tupleIJiiiEEEEENS5_10collective13CollectiveMma": "expert gemm",
        "_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalIN4cute5tupleIJiiiiEEENS1_10collective": "dense gemm",
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT": "dense gemm", "sm90_xmma_gemm_bf16bf16_bf16f32": "dense gemm",
        "triton_poi_fused_add_mul_0": "inductor fused", "triton_red_fused_cat_sum_1": "inductor fused",
        "gather_sum_kernel": "routing & indexing", "void at::native::sbtopk::gatherTopK<float>": "routing & indexing",
        "Memcpy HtoD (Pinned -> Device)": "copy",
        "void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor>": "eager elementwise",
        "void at::native::reduce_kernel<512, 1>": "eager elementwise",
        "ncclDevKernel_AllReduce_Sum": "other",
    }
    assert {name: bucket(name) for name in kinds} == kinds


def test_kernel_rows_are_per_step_and_gpu_only() -> None:
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(key="triton_poi_fused_add_0", count=6, self_device_time_total=3000., device_type=cuda),
              SimpleNamespace(key="chunk_kda_fwd_h_kernel", count=2, self_device_time_total=9000., device_type=cuda),
              SimpleNamespace(key="aten::mm", count=4, self_device_time_total=0., device_type=cpu)]
    assert kernel_rows(events, steps=2) == [("kda", "chunk_kda_fwd_h_kernel", 1.0, 4.5),
                                            ("inductor fused", "triton_poi_fused_add_0", 3.0, 1.5)]


def test_idle_gaps_clip_to_the_window_and_count_the_tail() -> None:
    busy = [(0., 100.), (50., 120.), (400., 500.), (510., 600.)]   # overlapping kernels merge; gaps 120-400, 500-510
    idle, gaps = idle_gaps(busy, window=(0., 700.), min_gap=50.)
    assert idle == 280. + 10. + 100.   # the tail after the last kernel counts as idle too
    assert gaps == [(120., 280.), (600., 100.)]
    idle, gaps = idle_gaps(busy, window=(200., 700.), min_gap=50.)
    assert idle == 200. + 10. + 100. and gaps[0] == (200., 200.)


def test_host_chains_give_the_ops_running_as_each_gap_began_and_those_that_took_it() -> None:
    ops = [(0., 1000., "step"), (110., 450., "aten::item"), (115., 130., "cudaStreamSynchronize"),
           (130., 390., "loader.py(9): __next__"), (140., 300., "aten::copy_"), (490., 520., "aten::add")]
    chains = host_chains(ops, [(120., 280.), (600., 100.)])
    assert chains[0] == (["step", "aten::item", "cudaStreamSynchronize"],
                         ["step", "aten::item", "loader.py(9): __next__", "aten::copy_"])
    assert chains[1] == (["step"], ["step"])
    # an op that covers less than half the gap is left out, however it nests
    assert host_chains(ops, [(100., 400.)])[0][1] == ["step", "aten::item", "loader.py(9): __next__"]


def test_where_names_the_innermost_op_then_the_innermost_python_frames() -> None:
    chain = ["trainer/train.py(300): train", "trainer/train.py(190): _micro_step", "aten::to", "aten::copy_",
             "torch/utils/data/dataloader.py(700): __next__", "aten::copy_"]
    assert where(chain) == ("aten::copy_ < torch/utils/data/dataloader.py(700): __next__ < "
                            "trainer/train.py(190): _micro_step < trainer/train.py(300): train")
    assert where(chain, frames=1) == "aten::copy_ < torch/utils/data/dataloader.py(700): __next__"
    assert where(["trainer/train.py(190): _micro_step"]) == "trainer/train.py(190): _micro_step"
    assert where([]) == "-"


def test_launching_thread_is_the_one_that_launched_most_kernels() -> None:
    events = [SimpleNamespace(name="cudaLaunchKernel", thread=7), SimpleNamespace(name="cuLaunchKernelEx", thread=7),
              SimpleNamespace(name="cudaLaunchKernel", thread=3), SimpleNamespace(name="aten::copy_", thread=3),
              SimpleNamespace(name="aten::copy_", thread=3)]
    assert launching_thread(events) == 7
    assert launching_thread([SimpleNamespace(name="aten::mm", thread=1)]) is None


def test_merged_covers_overlaps_once() -> None:
    assert merged([(5., 6.), (0., 2.), (1., 3.), (3., 4.)]) == [(0., 4.), (5., 6.)]


def _event(name: str, thread: int, start: float, end: float, kernels=(), stack=()) -> SimpleNamespace:  # noqa: ANN001
    return SimpleNamespace(name=name, thread=thread, device_type=torch.autograd.DeviceType.CPU,
                           time_range=SimpleNamespace(start=start, end=end), stack=list(stack),
                           kernels=[SimpleNamespace(name=k, duration=d) for k, d in kernels])


def test_kernel_sites_name_the_op_then_its_autograd_node_or_python_frame() -> None:
    add = "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>"
    copy = "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>"
    events = [
        _event("trainer/model/attn_res.py(117): add", 1, 0., 50.),
        _event("aten::add", 1, 10., 20., [(add, 7.)]),
        _event("trainer/model/kda.py(121): _mix", 1, 60., 90.),
        _event("aten::clone", 1, 61., 80.),
        _event("aten::copy_", 1, 62., 79., [(copy, 4.)]),
        _event("aten::mm", 1, 82., 85., [("nvjet_sm90_tst_256x128", 30.)]),   # a GEMM: not a kind asked for
        # the backward, on autograd's thread: the node names the site
        _event("autograd::engine::evaluate_function: AddBackward0", 2, 100., 130.),
        _event("aten::add", 2, 101., 110., [(add, 5.), (add, 6.)]),
        _event("autograd::engine::evaluate_function: AddBackward0", 2, 140., 150.),
        _event("aten::add", 2, 141., 149., [(add, 1.)]),
        # no Python-function events (torch 2.11): the op's own stack, torch's frames skipped
        _event("aten::remainder", 3, 200., 208., [(add, 2.)],
               stack=[f"{os.sep}torch{os.sep}_tensor.py(41): wrapped", "vision/encoder.py(40): patch_positions",
                      "vision/encoder.py(150): forward"]),
    ]
    sites = kernel_sites(events, ("eager elementwise", "copy"))
    assert sites == {("eager elementwise", "aten::add < trainer/model/attn_res.py(117): add"): [7., 1],
                     ("copy", "aten::copy_ < trainer/model/kda.py(121): _mix"): [4., 1],
                     ("eager elementwise", "aten::add < AddBackward0"): [12., 3],
                     ("eager elementwise", "aten::remainder < vision/encoder.py(40): patch_positions"): [2., 1]}
    assert label(events[-1]) == ("aten::remainder < vision/encoder.py(40): patch_positions < "
                                 "vision/encoder.py(150): forward")
