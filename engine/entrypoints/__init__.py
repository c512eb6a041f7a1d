"""What users call: the OpenAI-compatible server and its engine thread, the command lines, metrics."""
