#[tokio::main]
async fn main() {
    tracing_subscriber::fmt().with_env_filter("debug").init();
    let path = std::env::args().nth(1).expect("socket");
    let t = std::time::Instant::now();
    let c = hutch_core::agent::connect(std::path::Path::new(&path)).await;
    println!("connect: {:?} {:?}", c.as_ref().map(|_| ()).map_err(|e| e.to_string()), t.elapsed());
    let c = c.unwrap();
    println!("health: {:?} {:?}", c.health().await.map_err(|e| e.to_string()), t.elapsed());
}
