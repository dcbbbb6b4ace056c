"""`brisk kernels build | info`: build the C++ kernels for this CPU ahead of use, and say what runs here."""

from __future__ import annotations

import time

import click

from brisk.ops.isa import ISA_CHOICES


@click.group("kernels")
def kernels_group() -> None:
    """brisk's C++ kernels: build them for this CPU, or show the CPU, the tier chosen and why."""


@kernels_group.command("build")
@click.option("--jobs", "-j", type=int, default=None, help="Sources compiled at once (default: one per core).")
# the tier names of this machine's family (x86: avx2, avx2vnni, avx512; ARM64: neon, neon-dotprod, neon-i8mm)
@click.option("--isa", type=click.Choice(list(ISA_CHOICES)), default=None,
              help="Cap the tier (avx2 / neon: the baseline build on a bigger CPU); default: the best this CPU "
                   "reports.")
def build(jobs: int | None, isa: str | None) -> None:
    """Compile every kernel source for this CPU (cached ones are only loaded). `make install` runs this, so the
    first `brisk generate` starts at once; a source changed later is rebuilt on its next use."""
    from brisk.ops import kernels

    if isa is not None:
        kernels.configure(isa=isa)
    tier = kernels.kernel_tier()
    click.echo(f"tier {tier.name} ({' '.join(tier.cflags) or 'no ISA flags'}), cache {kernels.settings.cache_dir}")
    t0 = time.perf_counter()
    results = kernels.build_all(jobs)
    for r in results:
        state = "failed" if r.error else ("built" if r.built else "cached")
        click.echo(f"  {r.source:24s} {r.tier:9s} {state:7s} {r.seconds:6.1f} s" + (f"  {r.error}" if r.error else ""))
    failed = [r for r in results if r.error]
    click.echo(f"{len(results) - len(failed)}/{len(results)} kernel files ready in {time.perf_counter() - t0:.1f} s")
    if failed:  # brisk still runs (the reference paths), but an install should say it did not get its kernels
        raise SystemExit(1)


@kernels_group.command("info")
@click.option("--load/--no-load", default=True, show_default=True,
              help="Load (building if needed) the kernels to list the ops they register.")
def info(load: bool) -> None:
    """The CPU, the flags the tiers check, the tier chosen and why, and the ops loaded."""
    from brisk.ops import isa as isa_
    from brisk.ops import kernels

    flags = isa_.cpu_flags()
    model = isa_.cpuinfo_field("model name") or "unknown"
    vendor = isa_.cpu_vendor()
    click.echo(f"cpu: {model}" + (f" ({vendor})" if vendor else ""))
    click.echo("weight-stream prefetch of the tiled kernels: "
               + ("non-temporal (AMD)" if isa_.vendor_cflags(vendor) else "into L2"))
    checked = sorted(set().union(*(t.requires for t in isa_.TIERS)))
    click.echo("flags checked: " + " ".join(f"{f}{'' if f in flags else '(-)'}" for f in checked))
    if isa_.is_arm64():  # SVE / SME: no tier builds for them (the ARM64 kernels are NEON code)
        extra = sorted(f for f in flags if f.startswith(("sve", "sme")))
        if extra:
            click.echo("also reported (no tier uses them): " + " ".join(extra))
    else:
        extra = sorted(f for f in flags if f.startswith(("amx", "avx512_vp2intersect", "avx512_fp16", "avx_vnni")))
        if extra:
            click.echo("also reported (no tier uses them; amx_tile + amx_int8 enable the W8A8 GEMM's AMX path, "
                       "amx_bf16 the bfloat16 GEMM hand-off): " + " ".join(extra))
    s = kernels.settings
    click.echo(f"settings: enabled={s.enabled} isa={s.isa or 'best'} amx={s.amx} cache={s.cache_dir}")
    none = ("no /proc/cpuinfo Features (nor sysctl hw.optional): no kernels" if isa_.is_arm64()
            else "no /proc/cpuinfo: torch's CPU detection decides")
    for line in isa_.explain(flags, s.isa) if flags else [none]:
        click.echo("  " + line)
    tier = kernels.kernel_tier()
    click.echo(f"tier: {tier.name} ({' '.join(tier.cflags) or 'no ISA flags'})")
    for source in kernels.kernel_sources():
        library = kernels.library_path(source, tier)
        click.echo(f"  {source.name:24s} {'cached' if library.exists() else 'not built'}")
    if not load:
        return
    ops = kernels.get_ops()
    if ops is None:
        click.echo("ops: none (kernels disabled or not built): every op runs its PyTorch reference path")
        return
    import torch

    names = sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("brisk::"))
    click.echo(f"ops loaded ({len(names)}): " + " ".join(names))
    click.echo("amx: " + _amx_line(isa_.has_amx_int8(flags), s.amx, kernels.amx_min_rows()))
    bf16_gemm = s.enabled and kernels.bf16_gemm_rows() > 0 and hasattr(ops, "linear_small_bf16_gemm_rows")
    click.echo("bfloat16 linears of 4-8 rows: " + ("ATen's GEMM (oneDNN, AMX-BF16)" if bf16_gemm
                                                   else "linear_small_m's own loops"))


def _amx_line(cpu_has: bool, wanted: bool, min_rows: int) -> str:
    """Whether the W8A8 GEMM runs on AMX-INT8 tiles here, and why not."""
    if min_rows:
        return f"in use: W8A8 GEMMs of >= {min_rows} rows on AMX-INT8 tiles, fewer rows on VNNI"
    if not cpu_has:
        return "not in use (the CPU does not report amx_tile and amx_int8)"
    if not wanted:
        return "not in use (switched off: BRISK_DISABLE_AMX / configure(amx=False))"
    return "not in use (this build has no AMX path, or Linux refused the tile state: arch_prctl)"
