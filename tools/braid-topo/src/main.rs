//! `braid-topo`: see [`braid_topo::USAGE`].

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match braid_topo::run(&args, &|k| std::env::var(k).ok()) {
        Ok(out) => print!("{out}"),
        Err(braid_topo::Failure::Usage(msg)) => {
            eprintln!("braid-topo: {msg}\n\n{}", braid_topo::USAGE);
            std::process::exit(2);
        }
        Err(braid_topo::Failure::Error(msg)) => {
            eprintln!("braid-topo: error: {msg}");
            std::process::exit(1);
        }
    }
}
