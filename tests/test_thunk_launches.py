"""opsd_jax/programs/thunk_launches.py on a thunk sequence written as XLA:GPU dumps it: what
it counts per iteration of the main loop, with and without command buffers. The compiled
sampler's own counts are tests/test_gpu_compile.py's."""

import pytest

from opsd_jax.programs import thunk_launches

# A token loop (data-dependent) around a layer loop of known trip count 3 (the HLO says so).
HLO = """
HloModule m

%cond.1 (p: s32[]) -> pred[] {
  %p = s32[] parameter(0)
  %c = s32[] constant(9)
  ROOT %lt = pred[] compare(%p, %c), direction=LT
}

%body.1 (p: s32[]) -> s32[] {
  ROOT %p = s32[] parameter(0)
}

ENTRY %main (a: s32[]) -> s32[] {
  %a = s32[] parameter(0)
  %while.2 = s32[] while(%a), condition=%cond.1, body=%body.1, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %while.1 = s32[] while(%while.2), condition=%cond.1, body=%body.1
}
"""
METADATA = "\n".join(
    f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{name}"\n    thunk_id: {i}\n'
    f'  }}\n  thunk_kind: "kWhile"\n}}'
    for name, i in (("while.1", 5), ("while.2", 20))
)
PLAIN = """001: kCopy         [source       | next=005 (1)] kCopy
005: kWhile        [prev=001 (1) | sink        ]
condition:
    006: kCustomKernel [source       | next=007 (1)] input_reduce_fusion grid: [1, 1, 1] threads: [2, 1, 1]  shared_memory: 0 bytes
    007: kAsyncStart   [prev=006 (1) | next=010 (2)] stream=computation_stream[0], async_id=7
        008: kCollectiveKernel [source | sink] kCollectiveKernel
    009: kAsyncDone    [source       | sink        ] async_id=7
  body:
    011: kCustomKernel [source       | sink        ] loop_add_fusion grid: [1, 1, 1] threads: [2, 1, 1]  shared_memory: 0 bytes
    020: kWhile         [prev=011 (1) | next=030 (1)]
condition:
        021: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        044: kDynamicSliceFusion [source | next=046 (1) ] params=2, results=2
            045: kCublasLtMatmul [source | sink] kCublasLtMatmul
        061: kCustomKernel [prev=044 (1) | sink] filled_cache_attention grid: [2, 2, 3] threads: [128, 1, 1]  shared_memory: 6656 bytes
    030: kCustomKernel [prev=020 (1) | sink        ] fusion_122 grid: [64, 1, 1] threads: [32, 1, 1]  shared_memory: 0 bytes
"""
# The same program with the body in one command buffer (the layer loop unrolled into it).
BUFFERED = """001: kCopy         [source       | next=005 (1)] kCopy
005: kWhile        [prev=001 (1) | sink        ]
condition:
    006: kCustomKernel [source       | next=007 (1)] input_reduce_fusion grid: [1, 1, 1] threads: [2, 1, 1]  shared_memory: 0 bytes
  body:
    000: kCommandBuffer [source | sink]
        011: kCustomKernel [source       | sink        ] loop_add_fusion grid: [1, 1, 1] threads: [2, 1, 1]  shared_memory: 0 bytes
        020: kWhile         [prev=011 (1) | next=030 (1)]
condition:
          body:
            044: kDynamicSliceFusion [source | next=046 (1) ] params=2, results=2
                045: kCublasLtMatmul [source | sink] kCublasLtMatmul
            061: kCustomKernel [prev=044 (1) | sink] filled_cache_attention grid: [2, 2, 3] threads: [128, 1, 1]  shared_memory: 6656 bytes
        030: kCustomKernel [prev=020 (1) | sink        ] fusion_122 grid: [64, 1, 1] threads: [32, 1, 1]  shared_memory: 0 bytes
"""


def test_every_kernel_is_a_launch_without_command_buffers():
    # condition: reduce + collective (the async start's) = 2; body: add + 3 x (gemm + kernel)
    # (known count: no condition) + fusion = 8; one predicate read.
    got = thunk_launches.per_iteration(PLAIN, METADATA, HLO)
    assert got == thunk_launches.Launches(10, 0, 0, 1)


def test_a_command_buffer_is_one_launch_whatever_it_holds():
    got = thunk_launches.per_iteration(BUFFERED, METADATA, HLO)
    assert got == thunk_launches.Launches(2, 1, 8, 1)


def test_kernels_and_their_grids_are_found_at_any_depth():
    for text in (PLAIN, BUFFERED):
        found = thunk_launches.kernels(thunk_launches.parse(text), "filled_cache_attention")
        assert [k.grid for k in found] == [(2, 2, 3)]


def test_a_sequence_without_a_loop_is_refused():
    with pytest.raises(ValueError, match="no while loop"):
        thunk_launches.per_iteration("001: kCopy [source | sink] kCopy\n", "", HLO)
