"""Print the manifest of runtime patches: `python -m megatron_gspo.patches [--check]`."""

import sys

from megatron_gspo.patches import ALL_PATCHES

for patch in ALL_PATCHES:
    print(patch.describe())
    if "--check" in sys.argv:
        patch.check()
        print("- check: ok (installed", patch.installed_version() + ")\n")
