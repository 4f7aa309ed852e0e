"""An example of a user's ModelFn package (installed on executors, never uploaded)."""
