"""megatron-core torch_dist checkpoint (any layout it was written at) -> HF checkpoint.

    torchrun --nproc-per-node 2 tools/convert_megatron_to_hf.py -i ckpt -o hf_out --ep 2

Runs on CPU (gloo) or GPU (nccl); plain `python` runs one rank. The logic lives in
`megatron_gspo.weights.convert`.
"""

if __name__ == "__main__":  # run as a script: this checkout's package, Ctrl-C as one line
    import sys
    from pathlib import Path

    _root = str(Path(__file__).resolve().parents[1])
    if _root not in sys.path:
        sys.path.insert(0, _root)
    from megatron_gspo.run.interrupt import quiet_ctrl_c

    quiet_ctrl_c(Path(__file__).name)

import sys

from megatron_gspo.weights.convert import cli

if __name__ == "__main__":
    sys.exit(cli("megatron_to_hf"))
