"""The trained student leaving the tool: a standard PEFT adapter directory (and a merged model) from a
run's checkpoint, and the strict held-out verifier for any adapter directory (`miniverl eval`)."""
