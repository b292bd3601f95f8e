//! The `kvindex` binary: a thin layer over the library's [`cli`](kvindex::cli).

fn main() -> anyhow::Result<()> {
    kvindex::cli::main()
}
