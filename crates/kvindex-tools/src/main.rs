//! `kvindex-tools`: the development tools' binary, a thin layer over the crate's [`cli`](kvindex_tools::cli).

#[global_allocator]
static ALLOC: kvindex_tools::alloc::CountingAlloc = kvindex_tools::alloc::CountingAlloc;

fn main() -> anyhow::Result<()> {
    kvindex_tools::cli::main()
}
