/*
 * deltaflow: Delta's log on S3 committed by conditional create.
 *
 * Built by `deltaflow jars` (javac, against the installed pyspark's Hadoop, hadoop-aws and
 * delta-storage) and named in spark.delta.logStore.s3.impl / s3a.impl by deltaflow's Spark
 * session on an object-store warehouse.
 */
package io.deltaflow.storage;

import java.io.ByteArrayOutputStream;
import java.io.FileNotFoundException;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.FileAlreadyExistsException;
import java.util.Arrays;
import java.util.Iterator;
import java.util.UUID;

import io.delta.storage.HadoopFileSystemLogStore;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FSDataOutputStream;
import org.apache.hadoop.fs.FSDataOutputStreamBuilder;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.Path;

/**
 * A Delta log store for S3 whose commits are safe with any number of writers on any number of
 * hosts: a commit file is created by a PUT with {@code If-None-Match: *} (S3A's conditional
 * create, Hadoop 3.4.2 and later), so the second of two writers of one version fails with
 * {@link FileAlreadyExistsException}, which Delta treats as a lost race. Released Delta ships
 * only {@code S3SingleDriverLogStore}, whose put-if-absent holds within one JVM.
 *
 * <p>S3A retries a PUT whose answer was lost, and the retry then meets the object its first
 * attempt created. Every write therefore carries a random owner id in the object's metadata:
 * a refused write that finds its own id is a success, not a conflict.</p>
 */
public class ConditionalS3LogStore extends HadoopFileSystemLogStore {

    /** The object metadata key holding a write's owner id. */
    static final String OWNER = "deltaflow-write-id";
    /** S3A's createFile() option asking for a create-if-absent PUT. */
    static final String CONDITIONAL_CREATE = "fs.option.create.conditional.overwrite";

    public ConditionalS3LogStore(Configuration hadoopConf) {
        super(hadoopConf);
    }

    @Override
    public void write(Path path, Iterator<String> actions, Boolean overwrite,
                      Configuration hadoopConf) throws IOException {
        FileSystem fs = path.getFileSystem(hadoopConf);
        byte[] data = lines(actions);
        if (overwrite) {
            try (FSDataOutputStream out = fs.create(path, true)) {
                out.write(data);
            }
            return;
        }
        String owner = UUID.randomUUID().toString();
        try {
            FSDataOutputStreamBuilder<?, ?> builder = fs.createFile(path).overwrite(false);
            builder.must(CONDITIONAL_CREATE, true);
            builder.must("fs.s3a.create.header." + OWNER, owner);
            try (FSDataOutputStream out = builder.build()) {
                out.write(data);  // the PUT, with its condition, happens at close()
            }
        } catch (IOException failure) {
            byte[] found = ownerOf(fs, path);
            if (found != null && Arrays.equals(found, owner.getBytes(StandardCharsets.UTF_8))) {
                return;  // our own object: an earlier attempt landed and its answer was lost
            }
            if (found != null || fs.exists(path)) {
                FileAlreadyExistsException lost = new FileAlreadyExistsException(path.toString());
                lost.initCause(failure);
                throw lost;
            }
            throw failure;
        }
    }

    @Override
    public Boolean isPartialWriteVisible(Path path, Configuration hadoopConf) {
        return false;  // an S3 object appears whole or not at all
    }

    private static byte[] lines(Iterator<String> actions) {
        ByteArrayOutputStream out = new ByteArrayOutputStream();
        while (actions.hasNext()) {
            byte[] line = (actions.next() + "\n").getBytes(StandardCharsets.UTF_8);
            out.write(line, 0, line.length);
        }
        return out.toByteArray();
    }

    /** The owner id stored with the object at {@code path}; null when there is none. */
    private static byte[] ownerOf(FileSystem fs, Path path) {
        try {
            return fs.getXAttr(path, "header." + OWNER);
        } catch (FileNotFoundException missing) {
            return null;
        } catch (IOException | UnsupportedOperationException unknown) {
            return null;
        }
    }
}
