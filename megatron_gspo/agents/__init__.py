"""Agents written against the OpenAI API, trained token-exact: the endpoint they talk to
(`server.py`), the trajectories it records (`trajectory.py`) and the chat rendering that never
re-renders the model's own turns (`chat.py`)."""
