"""megatron-core torch_dist checkpoint (any layout it was written at) -> HF checkpoint.

    torchrun --nproc-per-node 2 tools/convert_megatron_to_hf.py -i ckpt -o hf_out --ep 2

Runs on CPU (gloo) or GPU (nccl); plain `python` runs one rank. The logic lives in
`megatron_gspo.weights.convert`.
"""

import sys

from megatron_gspo.weights.convert import cli

if __name__ == "__main__":
    sys.exit(cli("megatron_to_hf"))
