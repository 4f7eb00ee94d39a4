"""Where trainers from elsewhere meet Loom: one package each (``trl``, ...), each an optional extra."""
