"""Hugging Face checkpoints in and out of attnlab workdirs.

    python -m tools.hf import --hf_dir=DIR --workdir=WD [--mesh=fsdp=4,tensor=2]
    python -m tools.hf logits --workdir=WD --ids=I1,I2,... --out=FILE.npy
    python -m tools.hf export --workdir=WD --out=DIR [--model_type=llama|mistral|qwen2|qwen3|gpt2]
        [--dtype=float32|bfloat16]

Every refusal (an unknown model_type, a missing or truncated shard, a tensor of the wrong shape, a
config the family cannot express) is one `hf:` line and exit status 2, before anything is written.
"""

import argparse
import sys

import numpy as np

from tools.hf import convert
from tools.hf import export
from models.hf.families import HFError


def parse(argv):
  parser = argparse.ArgumentParser(prog='python -m tools.hf', description=__doc__.split('\n')[0])
  commands = parser.add_subparsers(dest='command', required=True)
  imp = commands.add_parser('import', help='a Hugging Face folder into a new workdir')
  imp.add_argument('--hf_dir', required=True)
  imp.add_argument('--workdir', required=True)
  imp.add_argument('--mesh', default='', help='config.mesh axes the parameters are placed on as '
                   'they are read, e.g. fsdp=4,tensor=2 (default: one device)')
  lg = commands.add_parser('logits', help="a workdir's float32 logits [T, V] for one row of ids")
  lg.add_argument('--workdir', required=True)
  lg.add_argument('--ids', required=True, help='comma-separated token ids')
  lg.add_argument('--out', required=True, help='a .npy file')
  ex = commands.add_parser('export', help="a workdir's newest parameters as a Hugging Face folder")
  ex.add_argument('--workdir', required=True)
  ex.add_argument('--out', required=True)
  ex.add_argument('--model_type', default=None, help='the family (default: read from the model)')
  ex.add_argument('--dtype', default='float32', help='float32 (bit for bit) | bfloat16')
  return parser.parse_args(argv)


def _ids(text):
  try:
    ids = [int(x) for x in text.split(',') if x.strip()]
  except ValueError:
    raise HFError(f'--ids={text!r}: valid: comma-separated integers, e.g. 1,42,7') from None
  if not ids:
    raise HFError('--ids is empty; valid: comma-separated integers, e.g. 1,42,7')
  return ids


def main(argv=None):
  args = parse(sys.argv[1:] if argv is None else argv)
  try:
    if args.command == 'import':
      convert.import_checkpoint(args.hf_dir, args.workdir, mesh=convert.parse_mesh(args.mesh))
    elif args.command == 'logits':
      out = export.logits(args.workdir, _ids(args.ids))
      np.save(args.out, out)
      print(f'hf: logits {list(out.shape)} written to {args.out}')
    else:
      export.export_checkpoint(args.workdir, args.out, model_type=args.model_type,
                               dtype=args.dtype)
  except HFError as e:
    print(f'hf: {" ".join(str(e).split())}', file=sys.stderr)
    sys.exit(2)
  except Exception as e:  # noqa: BLE001  (a checkpoint or tokenizer that cannot be read, ...)
    print(f'hf: {args.command} failed: {type(e).__name__}: {" ".join(str(e).split())}',
          file=sys.stderr)
    sys.exit(1)


if __name__ == '__main__':
  main()
