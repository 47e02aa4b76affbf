"""`jaxgen quantize` and `jaxgen convert`: their flags and their commands (a checkpoint
written from a model)."""

from __future__ import annotations

import json
import os

from jaxgen.cli.options import command

DTYPES = ["float32", "bfloat16", "float16"]


def add_quantize_parser(sub) -> None:
    """`jaxgen quantize`: its options and its command."""
    qz = command(
        sub,
        "quantize",
        "quantize a model and save it (LLM(model=OUT) loads it)",
        "Quantize a model's weights (calibrated methods read --calib text) and save a jaxgen "
        "checkpoint.",
    )
    qz.add_argument(
        "--method",
        required=True,
        choices=["rtn", "smoothquant", "llm_int8", "awq", "gptq", "nf4", "fp8", "qat"],
        help="quantization algorithm",
    )
    qz.add_argument(
        "--bits",
        type=int,
        default=None,
        help="3, 4 or 8 (integer methods; None: the method's)",
    )
    qz.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="-1 = per channel (None: the method's)",
    )
    qz.add_argument("--calib", default=None, help="calibration text file")
    qz.add_argument("--out", required=True, help="output checkpoint directory")
    qz.add_argument("--model", default=None, help="model to quantize (None: the embedded one)")
    qz.add_argument("--asymmetric", action="store_true", help="zero points (integer formats)")
    qz.add_argument("--double-quant", action="store_true", help="nf4: quantize the scales too")
    qz.add_argument(
        "--outlier-share",
        type=float,
        default=None,
        help="llm_int8: calibrate each linear's outlier threshold so that this share of its "
        "activations takes the float path (e.g. 0.01; default: the paper's threshold 6.0)",
    )
    qz.add_argument(
        "--scale-dtype",
        choices=["float32", "float16"],
        default="float32",
        help="integer formats: group scales in 16 bits (int8 --group-size 32 = Q8_0's layout)",
    )
    qz.add_argument("--act-order", action="store_true", help="gptq: largest Hessian rows first")
    qz.add_argument("--alpha", type=float, default=0.5, help="smoothquant migration strength")
    qz.set_defaults(func=quantize)


def quantize(args) -> int:
    from jaxgen.model import load_model, load_tokenizer, save_checkpoint
    from jaxgen.model.quantize import QuantSpec, quantize_model

    spec = QuantSpec(
        method=args.method,
        bits=args.bits,
        group_size=args.group_size,
        symmetric=not args.asymmetric,
        double_quant=args.double_quant,
        scale_dtype=args.scale_dtype,
        outlier_share=args.outlier_share,
        act_order=args.act_order,
        alpha=args.alpha,
    )
    if spec.needs_calibration and not args.calib:
        raise ValueError(f"--method {args.method} needs --calib FILE (calibration text)")
    if args.calib and not os.path.isfile(args.calib):
        raise ValueError(f"{args.calib}: calibration file not found")
    cfg, params = load_model(args.model)
    tokenizer = load_tokenizer(args.model)
    qparams, report = quantize_model(
        cfg, params, spec, tokenizer=tokenizer, calib_path=args.calib, progress=True
    )
    save_checkpoint(args.out, cfg, qparams, tokenizer)
    print(
        json.dumps(
            {
                "out": args.out,
                **{k: v for k, v in report.items() if not isinstance(v, list)},
            }
        )
    )
    return 0


def add_convert_parser(sub) -> None:
    """`jaxgen convert`: its options and its command."""
    conv = command(
        sub,
        "convert",
        "convert a HF dir or GGUF file to a jaxgen checkpoint",
        "Convert a Hugging Face model directory (safetensors) or a GGUF file into a jaxgen "
        "(orbax) checkpoint directory, tokenizer included; prints the destination.",
    )
    conv.add_argument("source", help="HF model directory or .gguf file")
    conv.add_argument("destination", help="new checkpoint directory")
    conv.add_argument("--dtype", default="float32", choices=DTYPES, help="stored dtype")
    conv.set_defaults(func=convert)


def convert(args) -> int:
    from jaxgen.model import convert as convert_model

    print(convert_model(args.source, args.destination, dtype=args.dtype))
    return 0
