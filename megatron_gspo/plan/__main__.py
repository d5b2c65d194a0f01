"""`python -m megatron_gspo.plan`: the launch planner's command line (`plan/planner.py`)."""

from megatron_gspo.plan.planner import main

raise SystemExit(main())
