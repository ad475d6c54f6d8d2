"""flash-attn-4's block-sparse kernels on the vertical-slash index (issue 42's probe): ``blocks`` turns the index
into its block lists (plain PyTorch, tested on CPU), ``ways`` calls the kernels (imports flash-attn-4)."""
