//! `POST /tunnel/{port}`: a byte stream to a TCP port inside the guest, carried by one
//! full-duplex HTTP/2 request (request body in, response body out). The host's data
//! proxy speaks HTTP/1.1 (and WebSocket upgrades) over it, so any server started in the
//! sandbox is reachable with no guest network.

use crate::http::files::http_error;
use axum::body::Body;
use axum::extract::Path;
use axum::http::StatusCode;
use axum::response::Response;
use futures::StreamExt;
use tokio::io::AsyncWriteExt;

pub async fn open(Path(port): Path<u16>, body: Body) -> Response {
    let stream = match tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
        Ok(s) => s,
        Err(e) => return http_error(StatusCode::BAD_GATEWAY, format!("port {port} is not open in the sandbox: {e}")),
    };
    let _ = stream.set_nodelay(true);
    let (read, mut write) = stream.into_split();
    tokio::spawn(async move {
        let mut incoming = body.into_data_stream();
        while let Some(Ok(chunk)) = incoming.next().await {
            if write.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = write.shutdown().await;
    });
    let outgoing = tokio_util::io::ReaderStream::new(read);
    Response::new(Body::from_stream(outgoing))
}
