//! Run the test API server stand-in by hand: prints the kubeconfig path, runs until killed.
//!
//! Usage: `podvolume-testbed-apiserver [--velero-crds] [CRD.yaml ...]`

use podvolume_testbed::TestApiServer;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut server = TestApiServer::start().await?;
    for arg in std::env::args().skip(1) {
        if arg == "--velero-crds" {
            server.install_velero_crds()?;
        } else if arg == "-h" || arg == "--help" {
            println!("usage: podvolume-testbed-apiserver [--velero-crds] [CRD.yaml ...]");
            return Ok(());
        } else {
            server.apply_crd_file(&arg)?;
        }
    }
    let path = server.keep_kubeconfig();
    println!("{}", path.display());
    eprintln!("serving {} (KUBECONFIG={})", server.url(), path.display());
    tokio::signal::ctrl_c().await?;
    Ok(())
}
