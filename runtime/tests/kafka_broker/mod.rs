//! A real Apache Kafka broker for tests: one node in KRaft mode, from the jars that
//! `.ci/install-tools.sh` resolves from Maven Central (`WEIR_KAFKA_LIBS`), run with the
//! machine's Java on free loopback ports, in a temporary directory, stopped when the test
//! process ends. Plus the client helpers the tests use: create topics, produce, read back
//! `read_committed`.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};
use rdkafka::{Offset, TopicPartitionList};

/// A running broker.
pub struct Broker {
    _child: Child,
    /// The broker's files, removed with it when this process ends (see the watchdog below).
    dir: std::path::PathBuf,
    client: Client,
    /// `<host>:<port>` of the SASL_PLAINTEXT listener (mechanism PLAIN, user `weir`,
    /// password [`SASL_PASSWORD`]).
    pub sasl_bootstrap: String,
}

/// The password of user `weir` on the SASL listener.
pub const SASL_PASSWORD: &str = "weir-test-secret-7f3a";

/// A record read back.
#[derive(Clone, Debug)]
pub struct ReadRecord {
    pub key: Option<String>,
    pub value: String,
    pub headers: Vec<(String, String)>,
    pub partition: i32,
}

/// A client of a broker: topics, produce, read back.
pub struct Client {
    /// `<host>:<port>`.
    pub bootstrap: String,
}

impl std::ops::Deref for Broker {
    type Target = Client;
    fn deref(&self) -> &Client {
        &self.client
    }
}

fn libs() -> String {
    let dir = std::env::var("WEIR_KAFKA_LIBS")
        .unwrap_or_else(|_| format!("{}/.cache/weir/kafka/lib", std::env::var("HOME").unwrap_or_default()));
    assert!(
        std::path::Path::new(&dir).join("slf4j-simple-1.7.36.jar").exists(),
        "the Kafka broker's jars are not in {dir}: run `bash .ci/install-tools.sh` (or set WEIR_KAFKA_LIBS)"
    );
    dir
}

/// The broker of this test process (on loopback), started on first use.
pub fn broker() -> &'static Broker {
    static BROKER: OnceLock<Broker> = OnceLock::new();
    BROKER.get_or_init(|| Broker::start_on("127.0.0.1"))
}

impl Broker {
    /// Starts a broker listening on `host` (free ports); it stops when this process ends.
    pub fn start_on(host: &str) -> Broker {
        let started = Instant::now();
        let dir = tempfile::tempdir().unwrap().keep();
        // The three listeners are held until all are chosen, so that no two get the same port.
        let listeners: Vec<_> = (0..3).map(|_| std::net::TcpListener::bind((host, 0)).unwrap()).collect();
        let [port, controller, sasl] = [0, 1, 2].map(|i| listeners[i].local_addr().unwrap().port());
        drop(listeners);
        let props = dir.join("server.properties");
        std::fs::write(
            &props,
            format!(
                "process.roles=broker,controller\n\
             node.id=1\n\
             controller.quorum.voters=1@{host}:{controller}\n\
             listeners=PLAINTEXT://{host}:{port},SASL_PLAINTEXT://{host}:{sasl},CONTROLLER://{host}:{controller}\n\
             advertised.listeners=PLAINTEXT://{host}:{port},SASL_PLAINTEXT://{host}:{sasl}\n\
             controller.listener.names=CONTROLLER\n\
             listener.security.protocol.map=PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT,CONTROLLER:PLAINTEXT\n\
             sasl.enabled.mechanisms=PLAIN\n\
             listener.name.sasl_plaintext.plain.sasl.jaas.config=\
             org.apache.kafka.common.security.plain.PlainLoginModule required user_weir=\"{SASL_PASSWORD}\";\n\
             inter.broker.listener.name=PLAINTEXT\n\
             log.dirs={}\n\
             num.partitions=1\n\
             auto.create.topics.enable=false\n\
             offsets.topic.replication.factor=1\n\
             offsets.topic.num.partitions=3\n\
             transaction.state.log.replication.factor=1\n\
             transaction.state.log.min.isr=1\n\
             transaction.state.log.num.partitions=3\n\
             group.initial.rebalance.delay.ms=0\n\
             transaction.max.timeout.ms=900000\n\
             transaction.abort.timed.out.transaction.cleanup.interval.ms=1000\n\
             log.cleaner.backoff.ms=1000\n",
                dir.join("data").display()
            ),
        )
        .unwrap();
        let classpath = format!("{}/*", libs());
        let java = |main: &str| {
            let mut c = Command::new("java");
            c.args(["-Xms128m", "-Xmx512m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Xshare:auto"])
                .arg("-Dorg.slf4j.simpleLogger.defaultLogLevel=warn")
                .args(["-cp", &classpath, main]);
            c
        };
        let format = java("kafka.tools.StorageTool")
            .args(["format", "-t", "weir-test-cluster-00001", "-c"])
            .arg(&props)
            .output()
            .expect("java runs");
        assert!(
            format.status.success(),
            "formatting the broker's storage: {}",
            String::from_utf8_lossy(&format.stderr)
        );
        let log = std::fs::File::create(dir.join("broker.log")).unwrap();
        // A shell watches this test process and, when it is gone, stops the broker and removes
        // its files (statics are never dropped, so nothing else would: every run left the
        // broker's logs and data in the temporary directory).
        let watchdog = concat!(
            r#"parent=$1; dir=$2; shift 2; "$@" & server=$!; "#,
            r#"while kill -0 "$parent" 2>/dev/null; do sleep 0.2; done; "#,
            r#"kill -9 "$server"; wait "$server"; rm -rf "$dir""#
        );
        let server = java("kafka.Kafka");
        let mut args: Vec<String> = vec![server.get_program().to_string_lossy().into()];
        args.extend(server.get_args().map(|a| a.to_string_lossy().to_string()));
        args.push(props.to_string_lossy().into());
        let child = Command::new("sh")
            .args(["-c", watchdog, "sh", &std::process::id().to_string()])
            .arg(&dir)
            .args(&args)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .expect("the broker starts");
        let bootstrap = format!("{host}:{port}");
        let deadline = Instant::now() + Duration::from_secs(90);
        let probe: BaseConsumer = config(&bootstrap).create().unwrap();
        loop {
            if probe.fetch_metadata(None, Duration::from_secs(2)).is_ok_and(|m| !m.brokers().is_empty()) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the Kafka broker did not start in 90 s; its log: {}",
                std::fs::read_to_string(dir.join("broker.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        eprintln!("kafka broker on {bootstrap} ready in {:?}", started.elapsed());
        Broker { _child: child, dir, client: Client { bootstrap }, sasl_bootstrap: format!("{host}:{sasl}") }
    }

    /// A client of the broker at `bootstrap` (for another thread).
    pub fn client(bootstrap: &str) -> Client {
        Client { bootstrap: bootstrap.to_string() }
    }

    /// The broker's log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("broker.log")).unwrap_or_default()
    }
}

/// A client configuration for `bootstrap`.
pub fn config(bootstrap: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", bootstrap).set("log_level", "3");
    c
}

impl Client {
    /// Creates `topic` with `partitions` partitions.
    pub fn create_topic(&self, topic: &str, partitions: i32) {
        let admin: AdminClient<DefaultClientContext> = config(&self.bootstrap).create().unwrap();
        let t = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
        // The admin client's own thread drives its futures: any executor will do.
        let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(20)));
        let r = futures::executor::block_on(admin.create_topics([&t], &options)).unwrap();
        for x in r {
            x.unwrap_or_else(|(t, e)| panic!("creating {t}: {e}"));
        }
        self.wait_for_partitions(topic, partitions);
    }

    /// Waits until the broker's metadata shows `partitions` partitions of `topic`.
    fn wait_for_partitions(&self, topic: &str, partitions: i32) {
        let probe: BaseConsumer = config(&self.bootstrap).create().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while !probe
            .fetch_metadata(Some(topic), Duration::from_secs(2))
            .is_ok_and(|m| m.topics().iter().any(|t| t.name() == topic && t.partitions().len() == partitions as usize))
        {
            assert!(Instant::now() < deadline, "topic {topic} not ready");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A plain (non-transactional, idempotent) producer.
    pub fn producer(&self) -> ThreadedProducer<DefaultProducerContext> {
        config(&self.bootstrap).set("enable.idempotence", "true").set("linger.ms", "5").create().unwrap()
    }

    /// Sends `(key, value)` records to `topic` and waits until all are acknowledged.
    pub fn produce(&self, topic: &str, records: impl IntoIterator<Item = (String, String)>) {
        let p = self.producer();
        for (k, v) in records {
            let mut rec = BaseRecord::to(topic).key(&k).payload(&v);
            loop {
                match p.send(rec) {
                    Ok(()) => break,
                    Err((KafkaError::MessageProduction(rdkafka::types::RDKafkaErrorCode::QueueFull), back)) => {
                        rec = back;
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err((e, _)) => panic!("producing to {topic}: {e}"),
                }
            }
        }
        p.flush(Duration::from_secs(30)).unwrap();
    }

    /// A producer with transactional id `id`, its transaction begun (and left to the caller
    /// to send in, commit or abort).
    pub fn open_transaction(&self, id: &str) -> ThreadedProducer<DefaultProducerContext> {
        let p: ThreadedProducer<DefaultProducerContext> =
            config(&self.bootstrap).set("transactional.id", id).create().unwrap();
        p.init_transactions(Duration::from_secs(30)).unwrap();
        p.begin_transaction().unwrap();
        p
    }

    /// Sends one record with `producer` (in its open transaction, if it has one) and waits until
    /// the broker has it.
    pub fn send(&self, producer: &ThreadedProducer<DefaultProducerContext>, topic: &str, key: &str, payload: &str) {
        producer.send(BaseRecord::to(topic).key(key).payload(payload)).map_err(|(e, _)| e).unwrap();
        producer.flush(Duration::from_secs(30)).unwrap();
    }

    /// Every record of `topic` visible to a `read_committed` consumer now, as (key, value).
    pub fn read_committed(&self, topic: &str) -> Vec<(Option<String>, String)> {
        self.read_committed_records(topic).into_iter().map(|r| (r.key, r.value)).collect()
    }

    /// Grows `topic` to `partitions` partitions.
    pub fn add_partitions(&self, topic: &str, partitions: usize) {
        let admin: AdminClient<DefaultClientContext> = config(&self.bootstrap).create().unwrap();
        let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(20)));
        let grow = rdkafka::admin::NewPartitions::new(topic, partitions);
        for r in futures::executor::block_on(admin.create_partitions([&grow], &options)).unwrap() {
            r.unwrap_or_else(|(t, e)| panic!("adding partitions to {t}: {e}"));
        }
        self.wait_for_partitions(topic, partitions as i32);
    }

    /// The offsets consumer group `group` committed for `topic`'s partitions `0..partitions`.
    pub fn committed_offsets(&self, group: &str, topic: &str, partitions: i32) -> Vec<i64> {
        let c: BaseConsumer = config(&self.bootstrap).set("group.id", group).create().unwrap();
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition(topic, p);
        }
        let got = c.committed_offsets(tpl, Duration::from_secs(10)).unwrap();
        (0..partitions).map(|p| got.find_partition(topic, p).and_then(|e| e.offset().to_raw()).unwrap_or(-1)).collect()
    }

    /// Commits `offsets` (one per partition, from 0) for consumer group `group`.
    pub fn commit_offsets(&self, group: &str, topic: &str, offsets: &[i64]) {
        let c: BaseConsumer = config(&self.bootstrap).set("group.id", group).create().unwrap();
        let mut tpl = TopicPartitionList::new();
        for (p, &o) in offsets.iter().enumerate() {
            tpl.add_partition_offset(topic, p as i32, Offset::Offset(o)).unwrap();
        }
        c.commit(&tpl, rdkafka::consumer::CommitMode::Sync).unwrap();
    }

    /// Every record of `topic` visible to a `read_committed` consumer now, with its headers.
    pub fn read_committed_records(&self, topic: &str) -> Vec<ReadRecord> {
        let c: BaseConsumer = config(&self.bootstrap)
            .set("group.id", "weir-test-reader")
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .set("enable.partition.eof", "true")
            .create()
            .unwrap();
        let md = c.fetch_metadata(Some(topic), Duration::from_secs(10)).unwrap();
        let partitions: Vec<i32> = md.topics()[0].partitions().iter().map(|p| p.id()).collect();
        // The end of each partition now, open transactions included (a `read_committed`
        // consumer's own watermark is the last stable offset). That consumer stops short of it,
        // and reports end-of-partition there, while another producer's transaction is open in
        // the partition, as in the marker topic every test shares: the read goes on until that
        // transaction ends and the position passes this offset.
        let ends: BaseConsumer = config(&self.bootstrap).set("isolation.level", "read_uncommitted").create().unwrap();
        let mut high = BTreeMap::new();
        let mut tpl = TopicPartitionList::new();
        for &p in &partitions {
            let (_, h) = ends.fetch_watermarks(topic, p, Duration::from_secs(10)).unwrap();
            high.insert(p, h);
            tpl.add_partition_offset(topic, p, Offset::Beginning).unwrap();
        }
        c.assign(&tpl).unwrap();
        let mut out = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let positions = c.position().unwrap();
            let behind: Vec<i32> = partitions
                .iter()
                .copied()
                .filter(|&p| {
                    let at = positions.find_partition(topic, p).and_then(|e| e.offset().to_raw()).unwrap_or(-1);
                    high[&p] > 0 && at < high[&p]
                })
                .collect();
            if behind.is_empty() {
                break;
            }
            assert!(Instant::now() < deadline, "reading {topic}: partitions {behind:?} did not reach their end");
            match c.poll(Duration::from_millis(200)) {
                None | Some(Err(KafkaError::PartitionEOF(_))) => {}
                Some(Err(e)) => panic!("reading {topic}: {e}"),
                Some(Ok(m)) => {
                    use rdkafka::message::Headers;
                    let text = |b: &[u8]| String::from_utf8_lossy(b).to_string();
                    out.push(ReadRecord {
                        key: m.key().map(text),
                        value: text(m.payload().unwrap_or_default()),
                        headers: m
                            .headers()
                            .map(|h| {
                                h.iter().map(|h| (h.key.to_string(), h.value.map(text).unwrap_or_default())).collect()
                            })
                            .unwrap_or_default(),
                        partition: m.partition(),
                    });
                }
            }
        }
        out
    }
}
