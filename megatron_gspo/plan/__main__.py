"""`python -m megatron_gspo.plan`: the launch planner's command line (`plan/planner.py`)."""

from megatron_gspo.plan.planner import main

if __name__ == "__main__":  # importing the module (the packaging test does) runs nothing
    raise SystemExit(main())
