"""The ``kvoffload bench`` suite: each module measures kvoffload beside a baseline in the same run."""
