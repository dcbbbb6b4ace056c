"""`brisk quantize`: a float model in, a quantized checkpoint folder out."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from brisk.data import calibration_text_path
from brisk.quant.config import LayerQuant, QuantizationConfig

if TYPE_CHECKING:  # torch and the model stay unimported until a command runs (fast `brisk --help`)
    import torch

    from brisk.model.loader import LoadedModel
    from brisk.quant.calib import CalibConfig


@click.command("quantize")
@click.argument("model")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--method", type=click.Choice(["rtn", "gptq", "awq", "qat", "smoothquant", "llm-int8", "squeezellm"]),
              default="rtn",
              show_default=True,
              help="How the codes are chosen. rtn: round to nearest, no data; gptq: error-compensating rounding "
                   "(Frantar et al. 2023); awq: activation-aware scaling + clipping (Lin et al. 2024); qat: "
                   "quantization-aware training (learned step sizes, distilled from the float model); "
                   "smoothquant: W8A8, int8 weights and activations after smoothing (Xiao et al. 2023); llm-int8: "
                   "vector-wise int8 with outlier columns in float (Dettmers et al. 2022); squeezellm: a table of "
                   "2^bits levels per output row by sensitivity-weighted k-means, the largest weights kept in "
                   "float (Kim et al. 2023). gptq, awq, smoothquant, llm-int8 and squeezellm calibrate on "
                   "--calib-text; qat trains on it.")
@click.option("--bits", type=click.Choice(["8", "4", "3", "2"]), default="4", show_default=True,
              help="Bits per weight of the decoder's linear layers.")
@click.option("--group-size", type=int, default=64, show_default=True,
              help="Weights per scale along the input dimension; -1 = one scale per output channel.")
@click.option("--sym", is_flag=True, help="Symmetric (zero point fixed at the middle code) instead of asymmetric.")
@click.option("--scheme", type=click.Choice(["int", "nf4"]), default="int", show_default=True,
              help="int: uniform levels; nf4: QLoRA's 4-bit NormalFloat levels (implies --bits 4).")
@click.option("--head-bits", type=click.Choice(["8", "none"]), default="8", show_default=True,
              help="Embedding and lm_head: 8-bit per channel, or none = keep them in float.")
@click.option("--skip", multiple=True, metavar="PATTERN",
              help="Keep modules matching this fnmatch pattern in float (repeatable), e.g. 'model.layers.0.*'.")
@click.option("--calib-text", "--text", "calib_text", type=click.Path(exists=True, dir_okay=False),
              default=str(calibration_text_path()),
              show_default="the bundled calibration text, Emma",
              help="gptq/awq: UTF-8 text the calibration samples are drawn from; qat: the training text.")
@click.option("--num-samples", type=int, default=16, show_default=True,
              help="gptq/awq: calibration samples (random windows of the text).")
@click.option("--seq-len", type=int, default=256, show_default=True,
              help="gptq/awq: tokens per sample; qat: tokens per training window.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="gptq/awq: seed of the sample offsets; qat: seed of the window order.")
@click.option("--batch-size", type=int, default=8, show_default=True,
              help="gptq/awq: samples per forward mini-batch (bounds memory, not the result); qat: windows per "
                   "optimizer step.")
@click.option("--damp", type=float, default=0.01, show_default=True,
              help="gptq: dampening, as a fraction of the Hessian's mean diagonal.")
@click.option("--act-order/--no-act-order", default=True, show_default=True,
              help="gptq: quantize columns by descending activation (static groups keep the format).")
@click.option("--init", "qat_init", type=click.Choice(["rtn", "gptq"]), default="rtn", show_default=True,
              help="qat: the starting codes, scales and zero points (gptq calibrates on --text first, in "
                   "column order).")
@click.option("--steps", type=int, default=100, show_default=True, help="qat: optimizer steps.")
@click.option("--lr", type=float, default=1e-4, show_default=True,
              help="qat: peak learning rate (AdamW, warm-up then cosine) of the weights and the log step sizes.")
@click.option("--alpha", type=float, default=None,
              help="qat: weight of the KL to the float model's distribution (1 - alpha: cross-entropy on the text; "
                   "default 1). smoothquant: migration strength in [0, 1] (default: searched per group of "
                   "linears on the calibration text).")
@click.option("--activations", type=click.Choice(["token", "tensor"]), default="token", show_default=True,
              help="smoothquant: int8 activation scales per token, computed at run time (dynamic), or one per "
                   "layer input, calibrated (static).")
@click.option("--threshold", default="auto", show_default=True, metavar="auto|T",
              help="llm-int8: input columns with |x| above the threshold in any token of a forward run in float; "
                   "auto = searched on the calibration text (the largest of 6, 4, 3, 2, 1.5, 1, 0.5 whose "
                   "next-token distributions stay within 0.001 nats a token of float activations'), 6.0 = "
                   "bitsandbytes' fixed one.")
@click.option("--outliers", default=None, metavar="FRACTION",
              help="squeezellm: share of each matrix's weights, the largest in magnitude, kept in float in a sparse "
                   "matrix, as a percentage (0.45%) or a fraction (0.0045); 0 = dense only. [default: 0.45%]")
@click.option("--sensitive", default=None, metavar="FRACTION",
              help="squeezellm: share of each matrix's weights, those of largest Fisher sensitivity, also kept in "
                   "float in the sparse part (the paper's sensitive values); 0 = none. [default: 0.05%]")
@click.option("--error-feedback/--no-error-feedback", default=True, show_default=True,
              help="squeezellm: choose the codes against the fixed tables with GPTQ's column order and error "
                   "updates on calibration inputs (brisk's addition), or each weight's nearest entry (the paper's).")
@click.option("--sensitivity-floor", type=float, default=None, metavar="F",
              help="squeezellm: the k-means weighs each weight by its Fisher sensitivity over its row's mean plus "
                   "F (0 = the Fisher sensitivity alone, as the paper). [default: 1 at 3 bits, 2 at 4 bits]")
@click.option("--temperature", type=float, default=1.0, show_default=True, help="qat: distillation temperature.")
@click.option("--bf16", "bf16_autocast", is_flag=True,
              help="qat: matmuls in bfloat16 autocast, float32 master weights (pays on AVX512-BF16 / AMX CPUs).")
@click.option("--force", is_flag=True, help="Write into OUT even if it already holds a checkpoint.")
def quantize(model: str, out: Path, method: str, bits: str, group_size: int, sym: bool, scheme: str,
             head_bits: str, skip: tuple[str, ...], calib_text: str | None, num_samples: int, seq_len: int,
             seed: int, batch_size: int, damp: float, act_order: bool, qat_init: str, steps: int, lr: float,
             alpha: float | None, activations: str, threshold: str, outliers: str | None, sensitive: str | None,
             error_feedback: bool,
             sensitivity_floor: float | None, temperature: float, bf16_autocast: bool, force: bool) -> None:
    """Quantize MODEL (GGUF file or HF folder; 'default' = SmolLM2-135M-Instruct) into the folder OUT.

    OUT loads with no other flags: brisk generate --model OUT, LLM(model=OUT).
    """
    from rich.console import Console

    from brisk.model.loader import load_model
    from brisk.quant.checkpoint import save_quantized
    from brisk.quant.rtn import HEAD_DEFAULT, plan_layers, rtn_quantize

    console = Console(stderr=True)
    if (out / "config.json").exists() and not force:
        raise click.ClickException(f"{out} already holds a checkpoint (config.json); pass --force to overwrite "
                                   "it or choose another folder")
    if scheme == "nf4" and bits != "4":
        raise click.ClickException("--scheme nf4 is a 4-bit format; use it with --bits 4")
    if method != "rtn" and scheme != "int":
        raise click.ClickException(f"--method {method} works on the uniform int grid; use --scheme int (or "
                                   "--method rtn for nf4)")
    if method != "rtn" and calib_text is None:
        raise click.ClickException(f"--method {method} needs calibration data: pass --calib-text FILE (a UTF-8 "
                                   "text, never the one you evaluate on)")
    for given, option in ((outliers, "--outliers"), (sensitive, "--sensitive")):
        if given is not None and method != "squeezellm":
            raise click.ClickException(f"{option} is SqueezeLLM's dense-and-sparse split; use it with --method "
                                       "squeezellm")
    given_feedback = click.get_current_context().get_parameter_source("error_feedback")
    if given_feedback is not click.core.ParameterSource.DEFAULT and method != "squeezellm":
        raise click.ClickException("--error-feedback / --no-error-feedback choose SqueezeLLM's codes; use them with "
                                   "--method squeezellm")
    if sensitivity_floor is not None and method != "squeezellm":
        raise click.ClickException("--sensitivity-floor weighs SqueezeLLM's k-means; use it with --method squeezellm")
    outlier_fraction = sensitive_fraction = 0.0
    if method == "squeezellm":
        from brisk.quant.squeezellm import DEFAULT_OUTLIERS, DEFAULT_SENSITIVE, parse_outliers

        try:
            outlier_fraction = DEFAULT_OUTLIERS if outliers is None else parse_outliers(outliers)
            sensitive_fraction = (DEFAULT_SENSITIVE if sensitive is None
                                  else parse_outliers(sensitive, "--sensitive", "0.05%"))
        except ValueError as e:
            raise click.ClickException(str(e)) from None
        default = _squeezellm_default(bits, scheme)
    else:
        default = LayerQuant(bits=int(bits), group_size=group_size, sym=sym or scheme == "nf4", scheme=scheme)
    if method in ("smoothquant", "llm-int8"):
        source = click.get_current_context().get_parameter_source
        given = [f"--{n.replace('_', '-')}" for n in ("bits", "group_size", "sym", "scheme")
                 if source(n) is not click.core.ParameterSource.DEFAULT]
        if given:
            raise click.ClickException(f"--method {method} is int8 per output channel with int8 activations; "
                                       f"drop {', '.join(given)}")
        from brisk.quant.smoothquant import W8

        default = W8
    if method == "smoothquant" and alpha is not None and not 0 <= alpha <= 1:
        raise click.ClickException(f"--alpha {alpha}: SmoothQuant's migration strength lies in [0, 1]")
    try:
        outlier_threshold = None if threshold == "auto" else float(threshold)
    except ValueError:
        raise click.ClickException(f"--threshold {threshold!r}: pass auto or a number (bitsandbytes uses "
                                   "6.0)") from None
    start = time.perf_counter()
    loaded = load_model(model, fuse=False)  # unfused: module names are the checkpoint's HF names
    from brisk.quant.support import check_method_supports

    try:  # each method declares the architectures (and MoE experts) it handles: quant/support.py
        check_method_supports(method, loaded.config)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    plan = plan_layers(loaded.model, loaded.config.tie_word_embeddings, default,
                       head=None if head_bits == "none" else HEAD_DEFAULT, skip=skip)
    if not plan:
        raise click.ClickException("no module left to quantize: the --skip patterns match every layer")
    if method == "rtn":
        tensors, qconfig = rtn_quantize(loaded, plan, default)
    elif method == "squeezellm":
        tensors, qconfig = _squeezellm(loaded, plan, default, str(calib_text), outlier_fraction, sensitive_fraction,
                                       num_samples, seq_len, seed, error_feedback, damp, batch_size, sensitivity_floor)
    elif method == "qat":
        tensors, qconfig = _qat(loaded, plan, default, out, str(calib_text), qat_init, steps, lr,
                                1.0 if alpha is None else alpha, temperature,
                                num_samples, seq_len, seed, batch_size, damp, bf16_autocast)
    else:
        from brisk.quant.calib import CalibConfig, CalibrationError

        try:
            calib = CalibConfig(str(calib_text), num_samples=num_samples, seq_len=seq_len, seed=seed,
                                batch_size=batch_size)
            tensors, qconfig = calibrated_quantize(loaded, plan, default, method, calib, damp=damp,
                                                   act_order=act_order, alpha=alpha, activations=activations,
                                                   threshold=outlier_threshold)
        except (CalibrationError, ValueError) as e:
            raise click.ClickException(str(e)) from None
    save_quantized(out, loaded.config, loaded.tokenizer, qconfig, tensors, loaded.generation_config)
    from brisk.prune.checkpoint import add_sparsity_config, read_sparsity_config

    if loaded.path.is_dir() and (pruned := read_sparsity_config(loaded.path)) is not None:
        pruned = {k: v for k, v in pruned.items() if k != "format"}
        add_sparsity_config(out, pruned)  # prune-then-quantize keeps the record of how the zeros came
    size = sum(p.stat().st_size for p in out.iterdir() if p.suffix == ".safetensors")
    from brisk.spec.vocab import VOCAB_FILE

    if loaded.path.is_dir() and (loaded.path / VOCAB_FILE).is_file():  # a distilled draft's vocabulary goes along
        shutil.copyfile(loaded.path / VOCAB_FILE, out / VOCAB_FILE)
    console.print(f"[bold green]quantized[/] {loaded.name} -> {out}: {len(plan)} modules ({default.label}, "
                  f"embedding/head {'float' if head_bits == 'none' else HEAD_DEFAULT.label}), "
                  f"{size / 1e6:.1f} MB of weights, {time.perf_counter() - start:.1f} s")
    console.print(f"run it:  brisk generate --model {out} 'Hello'     size:  brisk eval size --model {out}")


def _squeezellm_default(bits: str, scheme: str) -> LayerQuant:
    """SqueezeLLM's layer setting: a table per output row, so no group size, zero point or scheme to choose."""
    from brisk.quant.squeezellm import LUT_BITS

    if int(bits) not in LUT_BITS:
        raise click.ClickException(f"--method squeezellm stores a table of 2^bits values per output row: use --bits "
                                   f"{' or '.join(map(str, LUT_BITS))} (got --bits {bits})")
    source = click.get_current_context().get_parameter_source
    given = [f"--{n.replace('_', '-')}" for n in ("group_size", "sym") if source(n) is not
             click.core.ParameterSource.DEFAULT]
    if given:
        raise click.ClickException(f"--method squeezellm keeps one table per output row (no groups, no zero "
                                   f"points); drop {', '.join(given)}")
    assert scheme == "int", "checked before: calibrated methods take --scheme int"
    return LayerQuant(bits=int(bits), group_size=-1, sym=True, scheme="lut")


def _squeezellm(loaded: LoadedModel, plan: dict[str, LayerQuant], default: LayerQuant, text: str,
                outliers: float, sensitive: float, num_samples: int, seq_len: int, seed: int, error_feedback: bool,
                damp: float, batch_size: int, sensitivity_floor: float | None
                ) -> tuple[dict[str, torch.Tensor], QuantizationConfig]:
    """SqueezeLLM: Fisher sensitivities on the calibration text, then each planned linear's tables and outliers,
    its codes chosen with error feedback layer by layer (or nearest)."""
    from brisk.quant.calib import CalibConfig, CalibrationError
    from brisk.quant.squeezellm import SqueezeLLMConfig, squeezellm_quantize
    from brisk.train.forward import UntrainableModelError

    try:
        config = SqueezeLLMConfig(outliers=outliers, sensitive=sensitive, error_feedback=error_feedback, damp=damp,
                                  sensitivity_floor=sensitivity_floor)
        calib = CalibConfig(text, num_samples=num_samples, seq_len=seq_len, seed=seed, batch_size=batch_size)
        widest = max((loaded.model.get_submodule(n).in_features for n, q in plan.items() if q.scheme == "lut"),
                     default=0)
        if error_feedback and num_samples * seq_len < widest:
            # fewer tokens than inputs: H is rank-deficient and the OBS updates fit the calibration text's inputs
            # (measured on small random models: lower logits SQNR than nearest-entry codes on other inputs)
            click.echo(f"warning: {num_samples} x {seq_len} = {num_samples * seq_len} calibration tokens for "
                       f"layers of {widest} inputs: error feedback then fits the codes to those few inputs; pass "
                       "more --num-samples / --seq-len, or --no-error-feedback", err=True)
        return squeezellm_quantize(loaded, plan, default, calib, config)
    except (CalibrationError, UntrainableModelError, ValueError) as e:
        raise click.ClickException(str(e)) from None


def _qat(loaded: LoadedModel, plan: dict[str, LayerQuant], default: LayerQuant, out: Path, text: str, init: str,
         steps: int, lr: float, alpha: float, temperature: float, num_samples: int, seq_len: int, seed: int,
         batch_size: int, damp: float, bf16_autocast: bool = False
         ) -> tuple[dict[str, torch.Tensor], QuantizationConfig]:
    """QAT on the trainer: GPTQ's codes first when asked, then `steps` distillation steps, then the export."""
    from brisk.quant.calib import CalibConfig, CalibrationError
    from brisk.quant.qat import QATConfig, qat_quantize
    from brisk.train.data import TextWindows, TrainDataError
    from brisk.train.trainer import TrainConfig

    try:
        qat = QATConfig(init=init, alpha=alpha, temperature=temperature)
        config = TrainConfig(max_steps=steps, batch_size=batch_size, lr=lr, warmup_steps=min(10, steps // 10),
                             checkpoint_every=0, seed=seed, bf16_autocast=bf16_autocast)
        data = TextWindows.from_file(text, loaded.tokenizer, seq_len, seed)
        encoded, teacher = None, None
        if init == "gptq":
            import copy

            from brisk.quant.support import method_support

            if (refusal := method_support("gptq").refusal(loaded.config)) is not None:
                raise ValueError(f"--init gptq starts QAT from GPTQ's codes, and {refusal.split('; use')[0]}; "
                                 "use --init rtn")
            calib = CalibConfig(text, num_samples=num_samples, seq_len=seq_len, seed=seed, batch_size=batch_size)
            # GPTQ writes its quantized weights into the model as it goes: the teacher is the float model before it
            teacher = copy.deepcopy(loaded.model)
            tensors, _ = calibrated_quantize(loaded, plan, default, "gptq", calib, damp=damp, act_order=False)
            encoded = {name: {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".")
                              and k.rsplit(".", 1)[-1] in ("qweight", "scales", "qzeros")} for name in plan}
        result = qat_quantize(loaded, plan, default, qat, config, data, out, init=encoded, teacher=teacher)
    except (CalibrationError, TrainDataError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    shutil.rmtree(out / "last", ignore_errors=True)  # the trainer's resumable float state: no use once exported
    return result


def calibrated_quantize(loaded: LoadedModel, plan: dict[str, LayerQuant], default: LayerQuant, method: str,
                        calib: CalibConfig, damp: float = 0.01, act_order: bool = True, progress: bool = True,
                        alpha: float | None = None, activations: str = "token", threshold: float | None = None
                        ) -> tuple[dict[str, torch.Tensor], QuantizationConfig]:
    """GPTQ, AWQ, SmoothQuant or LLM.int8() over the layer-wise driver: checkpoint tensors and config, in RTN's
    format (SmoothQuant's static activations add each linear's `input_scale`).

    The decoder's planned linears get the method's codes; the embedding/head (not calibrated: the driver runs
    the decoder blocks only) get RTN's, as `brisk quantize --method rtn` gives them. `loaded` must be unfused.
    """
    from brisk.quant.awq import AWQConfig, awq_apply
    from brisk.quant.calib import load_calibration_ids, run_layerwise
    from brisk.quant.gptq import GPTQConfig, gptq_apply
    from brisk.quant.llm_int8 import LLMInt8Config, OutlierObserver, llm_int8_apply, outlier_summary, search_threshold
    from brisk.quant.rtn import checkpoint_tensors
    from brisk.quant.smoothquant import SmoothQuantConfig, smoothquant_apply

    ids = load_calibration_ids(loaded.tokenizer, calib)  # [N, L]
    encoded: dict[str, dict[str, torch.Tensor]] = {}
    method_config: GPTQConfig | AWQConfig | SmoothQuantConfig | LLMInt8Config
    if method == "gptq":
        method_config = GPTQConfig(damp=damp, act_order=act_order)
        apply = gptq_apply(plan, method_config, encoded)
    elif method == "awq":
        method_config = AWQConfig()
        apply = awq_apply(plan, method_config, encoded)
    elif method == "smoothquant":
        method_config = SmoothQuantConfig(alpha=alpha, activations=activations)
        apply = smoothquant_apply(plan, method_config, encoded)
    elif method == "llm-int8":
        method_config = LLMInt8Config(threshold=threshold)
        observers: dict[str, OutlierObserver] = {}
        apply = llm_int8_apply(plan, encoded, observers)
    else:
        raise ValueError(f"unknown calibrated method {method!r}; expected gptq, awq, smoothquant or llm-int8")
    run_layerwise(loaded.model, ids, apply, batch_size=calib.batch_size, progress=progress, label=method.upper())
    if isinstance(method_config, LLMInt8Config):
        if method_config.threshold is None:  # the decoder's weights are rounded: search on them
            method_config.threshold = search_threshold(loaded, ids, plan, method_config, progress)
        method_config.outliers = {n: o.counts(method_config.threshold) for n, o in observers.items()}
        if progress:
            from rich.console import Console

            Console(stderr=True).print("\n".join(outlier_summary(method_config)))
    qconfig = QuantizationConfig(method=method, default=default, modules=dict(plan),
                                 calibration=calib.to_dict(), method_config=method_config.to_dict())
    return checkpoint_tensors(loaded, plan, encoded), qconfig
