"""opsd_jax/programs/hbm_traffic.py on a hand-written optimized program: each counting rule on
its own (no compile), so a wrong rule fails here with the kernel named."""

from opsd_jax.programs import hbm_traffic

# A loop of 4 iterations whose body: slices one layer out of stacked weights (a copy: read and
# write one slice), multiplies with it (a library call reading the slice, with a workspace),
# writes one row of a cache in place, and runs a nested 3-trip loop of one small fusion.
PROGRAM = """
HloModule m, is_scheduled=true

%slice_layer (p0: bf16[4,256,512], p1: s32[]) -> bf16[1,256,512] {
  %p0 = bf16[4,256,512]{2,1,0} parameter(0)
  %p1 = s32[]{:T(128)} parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = bf16[1,256,512]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,256,512}
}

%gemm (q0: bf16[8,256], q1: bf16[1,256,512]) -> (bf16[8,512], s8[1048576]) {
  %q0 = bf16[8,256]{1,0} parameter(0)
  %q1 = bf16[1,256,512]{2,1,0} parameter(1)
  %b = bf16[256,512]{1,0} bitcast(%q1)
  ROOT %cc = (bf16[8,512]{1,0}, s8[1048576]{0}) custom-call(%q0, %b), custom_call_target="__cublas$gemm"
}

%write_row (c0: bf16[64,512], c1: bf16[1,512], c2: s32[]) -> bf16[64,512] {
  %c0 = bf16[64,512]{1,0} parameter(0)
  %c1 = bf16[1,512]{1,0} parameter(1)
  %c2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = bf16[64,512]{1,0} dynamic-update-slice(%c0, %c1, %c2, %z)
}

%small (s0: f32[128]) -> f32[128] {
  %s0 = f32[128]{0} parameter(0)
  ROOT %n = f32[128]{0} negate(%s0)
}

%inner_body (t: (s32[], f32[128])) -> (s32[], f32[128]) {
  %t = (s32[], f32[128]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[128]{0} get-tuple-element(%t), index=1
  %y = f32[128]{0} fusion(%x), kind=kLoop, calls=%small
  ROOT %r = (s32[], f32[128]{0}) tuple(%i, %y)
}

%inner_cond (t: (s32[], f32[128])) -> pred[] {
  %t = (s32[], f32[128]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %three), direction=LT
}

%body (u: (s32[], bf16[4,256,512], bf16[8,256], bf16[64,512], f32[128])) -> (s32[], bf16[4,256,512], bf16[8,256], bf16[64,512], f32[128]) {
  %u = (s32[], bf16[4,256,512]{2,1,0}, bf16[8,256]{1,0}, bf16[64,512]{1,0}, f32[128]{0}) parameter(0)
  %i = s32[] get-tuple-element(%u), index=0
  %w = bf16[4,256,512]{2,1,0} get-tuple-element(%u), index=1
  %h = bf16[8,256]{1,0} get-tuple-element(%u), index=2
  %cache = bf16[64,512]{1,0} get-tuple-element(%u), index=3
  %v = f32[128]{0} get-tuple-element(%u), index=4
  %layer = bf16[1,256,512]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%slice_layer
  %out = (bf16[8,512]{1,0}, s8[1048576]{0}) fusion(%h, %layer), kind=kCustom, calls=%gemm
  %o = bf16[8,512]{1,0} get-tuple-element(%out), index=0
  %row = bf16[1,512]{1,0} slice(%o), slice={[0:1], [0:512]}
  %new = bf16[64,512]{1,0} fusion(%cache, %row, %i), kind=kLoop, calls=%write_row
  %zero = s32[] constant(0)
  %inner = (s32[], f32[128]{0}) tuple(%zero, %v)
  %loop = (s32[], f32[128]{0}) while(%inner), condition=%inner_cond, body=%inner_body
  %v2 = f32[128]{0} get-tuple-element(%loop), index=1
  ROOT %res = (s32[], bf16[4,256,512]{2,1,0}, bf16[8,256]{1,0}, bf16[64,512]{1,0}, f32[128]{0}) tuple(%i, %w, %h, %new, %v2)
}

%cond (u: (s32[], bf16[4,256,512], bf16[8,256], bf16[64,512], f32[128])) -> pred[] {
  %u = (s32[], bf16[4,256,512]{2,1,0}, bf16[8,256]{1,0}, bf16[64,512]{1,0}, f32[128]{0}) parameter(0)
  %i = s32[] get-tuple-element(%u), index=0
  %four = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %four), direction=LT
}

ENTRY %main (a: bf16[4,256,512], b: bf16[8,256], c: bf16[64,512], d: f32[128]) -> bf16[64,512] {
  %a = bf16[4,256,512]{2,1,0} parameter(0)
  %b = bf16[8,256]{1,0} parameter(1)
  %c = bf16[64,512]{1,0} parameter(2)
  %d = f32[128]{0} parameter(3)
  %c2 = bf16[64,512]{1,0} copy(%c)
  %zero = s32[] constant(0)
  %t = (s32[], bf16[4,256,512]{2,1,0}, bf16[8,256]{1,0}, bf16[64,512]{1,0}, f32[128]{0}) tuple(%zero, %a, %b, %c2, %d)
  %w = (s32[], bf16[4,256,512]{2,1,0}, bf16[8,256]{1,0}, bf16[64,512]{1,0}, f32[128]{0}) while(%t), condition=%cond, body=%body
  ROOT %r = bf16[64,512]{1,0} get-tuple-element(%w), index=3
}
"""

LAYER = 256 * 512 * 2  # one layer's bf16 weights
ROW = 512 * 2


def test_each_rule_counts_what_the_kernel_touches():
    kernels = {k.name: k for k in hbm_traffic.loop_traffic(PROGRAM)}
    # Slicing a layer out of the stack reads one layer (and the s32 index) and writes it: a
    # kernel that only moves data.
    layer = kernels["layer"]
    assert (layer.read, layer.written, layer.moves_only) == (LAYER + 4, LAYER, True)
    # The library call reads its operands; its scratch workspace is not traffic.
    gemm = kernels["out"]
    assert (gemm.read, gemm.written, gemm.moves_only) == (8 * 256 * 2 + LAYER, 8 * 512 * 2, False)
    # An in-place cache update reads nothing of the cache and writes one row.
    write = kernels["new"]
    assert (write.read, write.written) == (ROW + 4, ROW)  # the row and the s32 slot
    # A top-level slice reads and writes what it selects.
    assert (kernels["row"].read, kernels["row"].written) == (ROW, ROW)
    # The nested loop's kernel counts once per inner iteration.
    assert kernels["y"].count == 3 and kernels["y"].bytes == 3 * 2 * 128 * 4
    assert set(kernels) == {"layer", "out", "new", "row", "y"}  # views and bookkeeping: free
    total = hbm_traffic.total_bytes(list(kernels.values()))
    assert total == sum(k.bytes for k in kernels.values())
    assert [k.name for k in hbm_traffic.data_movement(list(kernels.values()), LAYER)] == ["layer"]


def test_outside_the_loop_and_the_entry_loop_chosen():
    outside = hbm_traffic.outside_loops(PROGRAM)
    assert [(k.name, k.read, k.written) for k in outside] == [("c2", 64 * ROW, 64 * ROW)]
    assert "layer" in hbm_traffic.describe(hbm_traffic.loop_traffic(PROGRAM))


def test_a_pallas_kernel_is_named_and_its_reads_can_be_stated():
    """A Triton custom call carries its kernel name; `with_reads` replaces what that kernel is
    counted as reading (its operand is the whole cache, it reads a part) and nothing else."""
    text = """HloModule m

%body (p: (s32[], f32[4,1024])) -> (s32[], f32[4,1024]) {
  %p = (s32[], f32[4,1024]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %c = f32[4,1024] get-tuple-element(%p), index=1
  %k = f32[4,8] custom-call(%c), custom_call_target="__gpu$xla.gpu.triton", backend_config={debug = false, name = "filled_cache_attention", num_warps = 4 : i32}
  %g = f32[4,8] custom-call(%c), custom_call_target="__cublas$gemm"
  ROOT %t = (s32[], f32[4,1024]) tuple(%i, %c)
}

%cond (p: (s32[], f32[4,1024])) -> pred[] {
  %p = (s32[], f32[4,1024]) parameter(0)
  ROOT %x = pred[] constant(true)
}

ENTRY %main (a: (s32[], f32[4,1024])) -> (s32[], f32[4,1024]) {
  %a = (s32[], f32[4,1024]) parameter(0)
  ROOT %w = (s32[], f32[4,1024]) while(%a), condition=%cond, body=%body
}
"""
    kernels = hbm_traffic.loop_traffic(text)
    names = {k.name: k.kernel_name for k in kernels}
    assert names == {"k": "filled_cache_attention", "g": ""}, names
    assert all(k.read == 4 * 1024 * 4 for k in kernels)  # the whole operand, as counted
    stated = {k.name: k.read for k in hbm_traffic.with_reads(kernels, "filled_cache_attention", 96)}
    assert stated == {"k": 96, "g": 4 * 1024 * 4}
