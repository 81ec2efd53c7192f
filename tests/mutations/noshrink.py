"""A pytest plugin for the mutation check (`run.py` passes `-p noshrink`): Hypothesis reports a
failing program as found, without shrinking it (a verdict is all the check needs)."""

from hypothesis import Phase, settings

settings.register_profile("mutations", phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.load_profile("mutations")
