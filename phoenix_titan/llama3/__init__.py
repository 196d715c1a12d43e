"""torchtitan's llama3 configs with ``PhoenixTrainer`` (``--module phoenix_titan.llama3 --config llama3_debugmodel``)."""
