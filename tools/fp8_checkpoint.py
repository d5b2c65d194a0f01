"""Write the block-FP8 engine checkpoint of a BF16 HF checkpoint (FP8 recipes start from it).

    python tools/fp8_checkpoint.py --src BF16_DIR --out FP8_DIR [--config-only]

See megatron_gspo/weights/fp8_checkpoint.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_gspo.weights.fp8_checkpoint import main  # noqa: E402

if __name__ == "__main__":
    main()
