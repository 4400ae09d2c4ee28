"""The one exception type for mistakes a user can fix; imports nothing so any module can use it."""


class UserError(ValueError):
  """A wrong flag, path, file, line, config value or checkpoint that the user can fix.

  The message says what and where (the flag or config key, the file and line) and what was
  expected. Command-line programs started through `cli.run` print it as one line, `error: ...`,
  and exit with status 1: no traceback. Library callers (tests, Colab) catch it as a ValueError.
  """
