//! Tests of [`super`].

use super::*;

#[test]
fn keys_wait_for_their_setter_and_wrong_tokens_are_refused() {
    let server = StoreServer::bind("127.0.0.1:0", "secret").unwrap();
    let addr = server.addr.to_string();
    let timeout = Duration::from_secs(5);
    let reader = StoreClient::connect(&addr, "secret", 1, timeout).unwrap();
    let writer = StoreClient::connect(&addr, "secret", 0, timeout).unwrap();
    let waiting = std::thread::spawn(move || reader.get("k").unwrap());
    writer.set("k", b"v").unwrap();
    assert_eq!(waiting.join().unwrap(), b"v");
    let err = StoreClient::connect(&addr, "guess", 2, timeout).err().unwrap();
    assert!(matches!(&err, CommError::Refused { reason, .. } if reason.contains("token")), "{err}");
}

#[test]
fn a_monitor_that_closes_without_goodbye_aborts_the_others() {
    let server = StoreServer::bind("127.0.0.1:0", "t").unwrap();
    let addr = server.addr.to_string();
    let timeout = Duration::from_secs(5);
    let abort = Arc::new(Abort::default());
    let _watching = Monitor::start(&addr, "t", 0, timeout, Arc::clone(&abort)).unwrap();
    let dying = connect(&addr, "t", 3, MONITOR, timeout).unwrap();
    drop(dying);
    let deadline = Instant::now() + timeout;
    while abort.check().is_ok() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(abort.check().unwrap_err().blamed_rank(), Some(3));
}

#[test]
fn a_greeting_that_trickles_in_runs_out_of_time() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (server_side, _) = listener.accept().unwrap();
    let trickle = std::thread::spawn(move || {
        for byte in 0..20u8 {
            if client.write_all(&[byte]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    let started = Instant::now();
    let err = Hello::read(&mut Deadline::new(&server_side, Duration::from_millis(300))).unwrap_err();
    assert!(started.elapsed() < Duration::from_millis(900), "{:?}: {err}", started.elapsed());
    drop(server_side);
    trickle.join().unwrap();
}

#[test]
fn strangers_that_never_greet_cannot_pile_up_and_the_store_still_serves_after_them() {
    let server = StoreServer::bind("127.0.0.1:0", "t").unwrap();
    let addr = server.addr;
    let silent: Vec<TcpStream> = (0..MAX_GREETING).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // Give the store time to take them all in, then one more is closed at once.
    let deadline = Instant::now() + Duration::from_secs(5);
    while server.shared.greeting.load(Ordering::Acquire) < MAX_GREETING && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut extra = TcpStream::connect(addr).unwrap();
    extra.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert!(matches!(extra.read(&mut [0u8; 1]), Ok(0)), "closed without a word");
    drop(silent);
    while server.shared.greeting.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let client = StoreClient::connect(&addr.to_string(), "t", 0, Duration::from_secs(5)).unwrap();
    client.set("k", b"v").unwrap();
    assert_eq!(client.get("k").unwrap(), b"v");
}

/// A rank that reaches the store's port while something else holds it for a moment (another
/// process that bound it, accepted and closed) keeps trying until the store itself answers.
#[test]
fn a_connection_closed_before_the_greeting_is_answered_is_retried_until_the_store_answers() {
    let transient = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = transient.local_addr().unwrap();
    let holder = std::thread::spawn(move || {
        let (stream, _) = transient.accept().unwrap();
        drop(stream);
        drop(transient);
        StoreServer::bind(&addr.to_string(), "t").unwrap()
    });
    let client = StoreClient::connect(&addr.to_string(), "t", 1, Duration::from_secs(5));
    let _server = holder.join().unwrap();
    client.unwrap();
}
